/* Row kernels of the integer-dot low-bit matmul (method: lowbit_dot.c), shared by lowbit_dot.c and
 * decode_step.c. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define BLOCK 32
#define DOT_PREFETCH_BYTES 4096 /* how far ahead in each weight row the batch-1 rows prefetch */
/* The batch-1 rows prefetch the weights they stream non-temporally: a decode step reads every weight
 * once, and a plain fill pushes out what the step reads again — the KV cache, the activations, and the
 * Python and PyTorch code and data that run between the kernels (torch.rms_norm on one row took ~200 us
 * right after the LM head, ~17 warm). Measured on Zen 4, Gemma 3 270M (processes alternating): the LM
 * head 5.6-7.3 -> 4.3-6.2 ms, the fused layers 5.8-6.2 -> 4.7-5.5 ms, the rest of a step 1.6 -> 1.2-1.4 ms;
 * with its AVX2 rows (forced, same CPU) 13.1 vs 13.8 ms a token. */
#define STREAM_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_NTA)

/* Activation rows for the integer dot, in blocks of 32 with one float scale each (dx = amax / levels,
 * code = round-half-even(x * levels / amax)):
 *   one plane  (8-bit):  levels 127, the int8 codes in qx[M, K];
 *   two planes (15-bit): levels Q16_LEVELS, code = 128 * hi + lo with hi in [-127, 127] in qx[M, K] and
 *                        lo in [0, 127] in qx[M * K + ...]: each plane is a valid operand of the same
 *                        unsigned x signed byte products, and the dot is 128 * <w, hi> + <w, lo>, exact.
 * xsum[M, G]: the sum of the quantized x over each weight group (sum of dx * codes), INT4's offset term:
 * the offset then meets the same activations as the codes, so the result's error is <w, x - x_q>, as
 * llama.cpp's Q8_1 block sums make it; the exact sum of x would leave scale * <q, x - x_q>, 2-3x larger
 * for unsigned codes whose mean the offset cancels. */
#define Q8_LEVELS 127
#define Q16_LEVELS 16256 /* 127 * 128: hi never reaches -128, whose negation (INT8's sign trick) would overflow */

/* 32 int32 codes (four vectors, in element order) → 32 int8 in element order (|code| <= 127: no saturation). */
static inline __m256i pack_codes(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Rows [m0, m1) of quantize_rows (its layout is that of all M rows: the planes M * K bytes apart). */
static void quantize_row_range(const float *x, int64_t M, int64_t m0, int64_t m1, int64_t K, int64_t group, int planes,
                               int8_t *qx, float *dx, float *xsum) {
    const int64_t G = num_groups(K, group);
    const float levels = planes == 2 ? Q16_LEVELS : Q8_LEVELS;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t m = m0; m < m1; m++) {
        const float *xr = x + m * K;
        for (int64_t g = 0; g < G; g++) xsum[m * G + g] = 0.0f;
        for (int64_t b = 0; b < K / BLOCK; b++) {
            const float *xb = xr + b * BLOCK;
            __m256 v[4], top = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) top = _mm256_max_ps(top, _mm256_and_ps(v[i] = _mm256_loadu_ps(xb + 8 * i), magnitude));
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            const float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
            const float inv = amax > 0.0f ? levels / amax : 0.0f; /* a true division, as the reference's */
            dx[m * (K / BLOCK) + b] = amax / levels;
            __m256i q[4], sum = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) { /* x * inv rounded to nearest even (the default rounding mode) */
                q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
                sum = _mm256_add_epi32(sum, q[i]);
            }
            int8_t *hi = qx + m * K + b * BLOCK, *lo = hi + M * K;
            if (planes == 2) {
                __m256i h[4], l[4];
                for (int i = 0; i < 4; i++)
                    h[i] = _mm256_srai_epi32(q[i], 7), l[i] = _mm256_and_si256(q[i], _mm256_set1_epi32(127));
                _mm256_storeu_si256((__m256i *)hi, pack_codes(h[0], h[1], h[2], h[3]));
                _mm256_storeu_si256((__m256i *)lo, pack_codes(l[0], l[1], l[2], l[3]));
            } else {
                _mm256_storeu_si256((__m256i *)hi, pack_codes(q[0], q[1], q[2], q[3]));
            }
            const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
            const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, _MM_SHUFFLE(2, 3, 0, 1))));
            xsum[m * G + b * BLOCK / group] += dx[m * (K / BLOCK) + b] * (float)total;
        }
    }
}

static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t group, int planes, int8_t *qx, float *dx,
                          float *xsum) {
    quantize_row_range(x, M, 0, M, K, group, planes, qx, dx, xsum);
}

/* The bytes quantize_rows writes for M rows of K (qx's size). */
static inline int64_t activation_bytes(int64_t M, int64_t K, int planes) { return planes * M * K; }

/* BODY with PL an integer constant (1 or 2 planes), so the row functions it calls fold the plane count. */
#define WITH_PLANES(planes, ...)                                                                         \
    do {                                                                                                 \
        if ((planes) == 2) { enum { PL = 2 }; __VA_ARGS__ } else { enum { PL = 1 }; __VA_ARGS__ }        \
    } while (0)

/* ---- AVX2 ------------------------------------------------------------------------------------ */

static inline __m256i int4_codes(const uint8_t *bytes) { /* 16 bytes → 32 codes 0..15, in element order */
    __m128i b = _mm_loadu_si128((const __m128i *)bytes);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

/* 8 lanes, each the sum of 4 products, times pair_weight (1; 128 for the high plane: its shift folded
 * into the widening multiply-add). */
static inline __m256i dot_u8s8(__m256i u, __m256i s, __m256i pair_weight) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), pair_weight);
}
#define ONES16 _mm256_set1_epi16(1)
#define HIGH16 _mm256_set1_epi16(128)

/* The scales of one chunk's eight dot lanes (lanes 0-3 hold elements 0-15, lanes 4-7 elements 16-31):
 * with INT8's half groups (HALF_GROUP: GGUF Q6_K's sub-blocks of 16) each half has its own; otherwise
 * the chunk's group scale. s: the weight row's scales. */
static inline __m256 chunk_scales(const float *s, const int32_t *cg, int64_t c, int64_t group) {
    if (group == HALF_GROUP)
        return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double *)(s + 2 * c)))),
                                        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    return _mm256_broadcast_ss(s + cg[c]);
}

/* The integer dot of one chunk over PL planes: xq the high (or only) plane, xl the low one. */
#define PLANES_DOT256(DOT, xq, xl) (PL == 1 ? DOT(xq, ONES16) : _mm256_add_epi32(DOT(xq, HIGH16), DOT##_LOW(xl)))

/* One output row n against MR activation rows: acc[m] gathers scale * dx * dot per chunk. */
#define DEFINE_ROW_AVX2(NAME, WEIGHT_T, ROW_BYTES, DOT)                                                   \
    static inline __attribute__((always_inline)) void NAME(                                              \
        const WEIGHT_T *row, const float *scale, const int8_t *qx, const float *dx, int64_t K, int64_t group, \
        const int32_t *cg, float *out, const int MR, const float *offset, const float *xsum, int64_t lo, \
        const int PL) {                                                                                  \
        const int64_t G = num_groups(K, group), B = K / BLOCK;                                           \
        __m256 acc[8][2];                                                                                \
        for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();                        \
        for (int64_t c = 0; c < B; c++) {                                                                \
            const __m256 ks = chunk_scales(scale, cg, c, group);                                         \
            DOT##_PREPARE(row + c * (ROW_BYTES));                                                        \
            for (int m = 0; m < MR; m++) {                                                               \
                const int8_t *p = qx + m * K + c * BLOCK;                                                \
                const __m256i xq = _mm256_loadu_si256((const __m256i *)p);                               \
                const __m256i xl = PL == 1 ? xq : _mm256_loadu_si256((const __m256i *)(p + lo));         \
                acc[m][c & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PLANES_DOT256(DOT, xq, xl)),          \
                                                _mm256_mul_ps(ks, _mm256_set1_ps(dx[m * B + c])), acc[m][c & 1]); \
            }                                                                                            \
        }                                                                                                \
        for (int m = 0; m < MR; m++) {                                                                   \
            out[m] = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));                                          \
            if (offset) /* INT4's offset term */                                                         \
                for (int64_t g = 0; g < G; g++) out[m] += offset[g] * xsum[m * G + g];                   \
        }                                                                                                \
    }

#define INT4_AVX2_PREPARE(p) const __m256i w = int4_codes((const uint8_t *)(p))
#define INT4_AVX2(xq, k) dot_u8s8(w, xq, k)
#define INT4_AVX2_LOW(xl) dot_u8s8(w, xl, ONES16)
#define INT8_AVX2_PREPARE(p) const __m256i w = _mm256_loadu_si256((const __m256i *)(p)); \
    const __m256i wabs = _mm256_sign_epi8(w, w)
#define INT8_AVX2(xq, k) dot_u8s8(wabs, _mm256_sign_epi8(xq, w), k)
#define INT8_AVX2_LOW(xl) dot_u8s8(xl, w, ONES16) /* the low plane is unsigned: no sign trick */

DEFINE_ROW_AVX2(int4_row_avx2, uint8_t, BLOCK / 2, INT4_AVX2)
DEFINE_ROW_AVX2(int8_row_avx2, int8_t, BLOCK, INT8_AVX2)

/* sum_g offset[g] * xsum[g] as eight lanes (INT4's offset term for one weight row, batch 1). */
static inline __m256 offset_terms(const float *offset, const float *xsum, int64_t G) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(offset + g), _mm256_loadu_ps(xsum + g), acc);
    if (g < G) {
        const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(G - g)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(offset + g, k), _mm256_maskload_ps(xsum + g, k), acc);
    }
    return acc;
}

/* One activation row (batch-1 decode) against NR <= 4 weight rows at a time (rows `stride` bytes
 * apart), AVX2: the NR rows' accumulator chains interleave and share each activation load and its
 * block scale, where one row alone waits on its chain's FMA latency. INT4's offset term, eight groups
 * a step. */
#define DEFINE_ROWS_AVX2_M1(NAME, WEIGHT_T, ROW_BYTES, DOT)                                               \
    static inline __attribute__((always_inline)) void NAME(                                              \
        const WEIGHT_T *row, int64_t stride, const float *scale, const int8_t *qx, const float *dx,      \
        int64_t K, int64_t group, const int32_t *cg, float *out, const int NR, const float *offset,      \
        const float *xsum, int64_t lo, const int PL) {                                                   \
        const int64_t B = K / BLOCK, G = num_groups(K, group);                                           \
        __m256 acc[4][2];                                                                                \
        for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                        \
        for (int64_t c = 0; c < B; c++) {                                                                \
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + c * BLOCK));                    \
            const __m256i xl = PL == 1 ? xq : _mm256_loadu_si256((const __m256i *)(qx + lo + c * BLOCK)); \
            const __m256 d = _mm256_broadcast_ss(dx + c);                                                \
            for (int r = 0; r < NR; r++) {                                                               \
                /* DRAM-resident weights: the hardware prefetch alone leaves the loads waiting */      \
                STREAM_PREFETCH(row + r * stride + c * (ROW_BYTES) + DOT_PREFETCH_BYTES); \
                DOT##_PREPARE(row + r * stride + c * (ROW_BYTES));                                       \
                const __m256 k = _mm256_mul_ps(chunk_scales(scale + r * G, cg, c, group), d);            \
                acc[r][c & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PLANES_DOT256(DOT, xq, xl)), k, acc[r][c & 1]); \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < NR; r++) {                                                                   \
            __m256 sum = _mm256_add_ps(acc[r][0], acc[r][1]);                                            \
            if (offset) sum = _mm256_add_ps(sum, offset_terms(offset + r * G, xsum, G));                 \
            out[r] = hsum(sum);                                                                          \
        }                                                                                                \
    }


/* INT4 at batch 1 takes the activations with each run of R chunks interleaved by halves (R: 2 for
 * AVX2's rows, 4 for VNNI's): the first 16 elements of each chunk of the run, then the last 16 of
 * each — for R = 2, x[c][0:16] x[c+1][0:16] x[c][16:32] x[c+1][16:32]. That is the order in which one
 * load of the R chunks' codes (16 bytes each) gives its low nibbles, then its high ones: so R chunks
 * cost one load, two masks and a shift, where unpacking chunk by chunk costs a shuffle per chunk too,
 * on CPUs where batch-1 decode is compute-bound. A last run shorter than R keeps its natural order. */
static inline void interleave_halves(const int8_t *qx, int64_t K, int planes, int64_t R, int8_t *out) {
    const int64_t B = K / BLOCK, H = BLOCK / 2;
    for (int p = 0; p < planes; p++) {
        const int8_t *src = qx + p * K;
        int8_t *dst = out + p * K;
        int64_t c = 0;
        for (; c + R <= B; c += R)
            for (int64_t i = 0; i < R; i++)
                for (int h = 0; h < 2; h++) memcpy(dst + c * BLOCK + (h * R + i) * H, src + (c + i) * BLOCK + h * H, H);
        memcpy(dst + c * BLOCK, src + c * BLOCK, (B - c) * BLOCK);
    }
}

/* Two chunks' dot of one weight row, lanes 0-3 chunk c and 4-7 chunk c + 1 (xa, xb: interleave_halves' halves, R = 2). */
static inline __m256i int4_pair_dot(__m256i bytes, __m256i xa, __m256i xb, __m256i pair_weight) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i low = _mm256_and_si256(bytes, mask), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    const __m256i sum16 = _mm256_add_epi16(_mm256_maddubs_epi16(low, xa), _mm256_maddubs_epi16(high, xb));
    return _mm256_madd_epi16(sum16, pair_weight);
}

/* As DEFINE_ROWS_AVX2_M1's rows, for INT4 with qx interleaved by halves (R = 2). */
static inline __attribute__((always_inline)) void int4_rows_avx2_m1(
    const uint8_t *row, int64_t stride, const float *scale, const int8_t *qx, const float *dx, int64_t K,
    int64_t group, const int32_t *cg, float *out, const int NR, const float *offset, const float *xsum, int64_t lo,
    const int PL) {
    const int64_t B = K / BLOCK, G = num_groups(K, group);
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 acc[4][2];
    for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t c = 0;
    if (group == BLOCK) /* GGUF's blocks: four chunks' scales a load, times their dx in one product */
        for (; c + 4 <= B; c += 4) {
            const int8_t *p = qx + c * BLOCK;
            __m256i x[2][2], l[2][2];
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 2; i++) {
                    x[h][i] = _mm256_loadu_si256((const __m256i *)(p + (2 * h + i) * BLOCK));
                    l[h][i] = PL == 1 ? x[h][i] : _mm256_loadu_si256((const __m256i *)(p + lo + (2 * h + i) * BLOCK));
                }
            const __m128 d4 = _mm_loadu_ps(dx + c);
            for (int r = 0; r < NR; r++) {
                const uint8_t *w = row + r * stride + c * (BLOCK / 2);
                STREAM_PREFETCH(w + DOT_PREFETCH_BYTES);
                const __m256 k4 = _mm256_castps128_ps256(_mm_mul_ps(_mm_loadu_ps(scale + r * G + c), d4));
                for (int h = 0; h < 2; h++) {
                    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + h * BLOCK));
                    __m256i d = int4_pair_dot(bytes, x[h][0], x[h][1], PL == 1 ? ONES16 : HIGH16);
                    if (PL == 2) d = _mm256_add_epi32(d, int4_pair_dot(bytes, l[h][0], l[h][1], ONES16));
                    const __m256 k = _mm256_permutevar8x32_ps(k4, _mm256_add_epi32(spread, _mm256_set1_epi32(2 * h)));
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), k, acc[r][h]);
                }
            }
        }
    for (; c + 2 <= B; c += 2) {
        const int8_t *p = qx + c * BLOCK;
        const __m256i xa = _mm256_loadu_si256((const __m256i *)p), xb = _mm256_loadu_si256((const __m256i *)(p + BLOCK));
        const __m256i la = PL == 1 ? xa : _mm256_loadu_si256((const __m256i *)(p + lo));
        const __m256i lb = PL == 1 ? xb : _mm256_loadu_si256((const __m256i *)(p + lo + BLOCK));
        const __m128 d2 = _mm_castpd_ps(_mm_load_sd((const double *)(dx + c)));
        for (int r = 0; r < NR; r++) {
            const uint8_t *w = row + r * stride + c * (BLOCK / 2);
            STREAM_PREFETCH(w + DOT_PREFETCH_BYTES);
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)w);
            __m256i d = int4_pair_dot(bytes, xa, xb, PL == 1 ? ONES16 : HIGH16);
            if (PL == 2) d = _mm256_add_epi32(d, int4_pair_dot(bytes, la, lb, ONES16));
            const __m128 s2 = _mm_unpacklo_ps(_mm_load_ss(scale + r * G + cg[c]), _mm_load_ss(scale + r * G + cg[c + 1]));
            const __m256 k = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(s2, d2)), spread);
            acc[r][(c >> 1) & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), k, acc[r][(c >> 1) & 1]);
        }
    }
    if (c < B) { /* the odd last chunk, in natural order */
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + c * BLOCK));
        const __m256i xl = PL == 1 ? xq : _mm256_loadu_si256((const __m256i *)(qx + lo + c * BLOCK));
        const __m256 d = _mm256_broadcast_ss(dx + c);
        for (int r = 0; r < NR; r++) {
            INT4_AVX2_PREPARE(row + r * stride + c * (BLOCK / 2));
            const __m256 k = _mm256_mul_ps(_mm256_broadcast_ss(scale + r * G + cg[c]), d);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PLANES_DOT256(INT4_AVX2, xq, xl)), k, acc[r][0]);
        }
    }
    for (int r = 0; r < NR; r++) {
        __m256 sum = _mm256_add_ps(acc[r][0], acc[r][1]);
        if (offset) sum = _mm256_add_ps(sum, offset_terms(offset + r * G, xsum, G));
        out[r] = hsum(sum);
    }
}
DEFINE_ROWS_AVX2_M1(int8_rows_avx2_m1, int8_t, BLOCK, INT8_AVX2)

/* ---- AVX512-VNNI: two chunks (64 weights) per dpbusd ------------------------------------------- */

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

VNNI static inline __m512i int4_codes2(const uint8_t *bytes) { /* 32 bytes → 64 codes, chunk by chunk */
    __m256i b = _mm256_loadu_si256((const __m256i *)bytes);
    __m256i lo = _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F));
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* lo0 lo1 hi0 hi1 */
    return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));         /* lo0 hi0 lo1 hi1 */
}

/* As PLANES_DOT256, with VNNI's dpbusd: the high plane's dot, shifted, is the low plane's accumulator. */
#define PLANES_DOT512(w, SIGNED, xq, xl)                                                                 \
    (PL == 1 ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, SIGNED(xq))                                 \
             : _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, SIGNED(xq)), 7), \
                                   w, SIGNED(xl)))
#define PLANES_DOT256_VNNI(w, SIGNED, xq, xl)                                                            \
    (PL == 1 ? _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, SIGNED(xq))                                 \
             : _mm256_dpbusd_epi32(_mm256_slli_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, SIGNED(xq)), 7), \
                                   w, SIGNED(xl)))

/* v[0], v[1] → lanes 0-7 v[0], lanes 8-15 v[1] (the scales of two chunks, beside their dpbusd lanes). */
VNNI static inline __m512 pair_lanes(const float *v) {
    const __m512 two = _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)v)));
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), two);
}

/* The scales of two chunks' sixteen dpbusd lanes (4i..4i+3: elements 16i..16i+15 of the pair), as
 * chunk_scales: four half-group scales, or each chunk's group scale. */
VNNI static inline __m512 chunk_pair_scales(const float *s, const int32_t *cg, int64_t c, int64_t group) {
    if (group == HALF_GROUP)
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                     _mm512_castps128_ps512(_mm_loadu_ps(s + 2 * c)));
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[cg[c]]), _mm512_set1_ps(s[cg[c + 1]]));
}

/* lanes 0-7 a, lanes 8-15 b */
VNNI static inline __m512 lane_halves(float a, float b) { return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b)); }

#define DEFINE_ROW_VNNI(NAME, WEIGHT_T, ROW_BYTES, PREPARE, SIGNED)                                      \
    VNNI static inline __attribute__((always_inline)) void NAME(const WEIGHT_T *row, const float *scale, const int8_t *qx, const float *dx,  \
                          int64_t K, int64_t group, const int32_t *cg, float *out, const int MR, const float *offset,      \
                          const float *xsum, int64_t lo, const int PL) {                                \
        const int64_t B = K / BLOCK, G = num_groups(K, group);                                           \
        __m512 acc[8];                                                                                   \
        for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();                                       \
        /* INT4's offset term, 16 groups a step, folded into the accumulator before its one reduction */ \
        if (offset)                                                                                      \
            for (int64_t g = 0; g < G; g += 16) {                                                        \
                const __mmask16 k = G - g >= 16 ? 0xFFFF : (__mmask16)((1u << (G - g)) - 1);             \
                const __m512 o = _mm512_maskz_loadu_ps(k, offset + g);                                   \
                for (int m = 0; m < MR; m++)                                                             \
                    acc[m] = _mm512_fmadd_ps(o, _mm512_maskz_loadu_ps(k, xsum + m * G + g), acc[m]);     \
            }                                                                                            \
        int64_t c = 0;                                                                                   \
        for (; c + 1 < B; c += 2) {                                                                      \
            const __m512 ks = chunk_pair_scales(scale, cg, c, group);                                    \
            PREPARE(row + c * (ROW_BYTES));                                                              \
            for (int m = 0; m < MR; m++) {                                                               \
                const int8_t *p = qx + m * K + c * BLOCK;                                                \
                const __m512i xq = _mm512_loadu_si512((const void *)p);                                  \
                const __m512i xl = PL == 1 ? xq : _mm512_loadu_si512((const void *)(p + lo));            \
                __m512i d = PLANES_DOT512(w, SIGNED, xq, xl);                                            \
                const __m512 k = _mm512_mul_ps(ks, lane_halves(dx[m * B + c], dx[m * B + c + 1]));          \
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), k, acc[m]);                              \
            }                                                                                            \
        }                                                                                                \
        for (int m = 0; m < MR; m++) out[m] = _mm512_reduce_add_ps(acc[m]);                              \
        if (c < B) { /* an odd chunk count: the last one at 256 bits */                                 \
            const __m256 ks = chunk_scales(scale, cg, c, group);                                         \
            PREPARE##_TAIL(row + c * (ROW_BYTES));                                                       \
            for (int m = 0; m < MR; m++) {                                                               \
                const int8_t *p = qx + m * K + c * BLOCK;                                                \
                const __m256i xq = _mm256_loadu_si256((const __m256i *)p);                               \
                const __m256i xl = PL == 1 ? xq : _mm256_loadu_si256((const __m256i *)(p + lo));         \
                __m256i d = PLANES_DOT256_VNNI(wt, SIGNED##_TAIL, xq, xl);                               \
                out[m] += dx[m * B + c] * hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(d), ks));                \
            }                                                                                            \
        }                                                                                                \
    }

/* INT4 at batch 1: four chunks a step, qx interleaved by halves (R = 4), so one 64-byte load gives
 * the four chunks' low nibbles (against xa) and high ones (against xb) and dpbusd's lanes 4i..4i+3 hold
 * chunk c + i; the four chunks' scales are one load. Leaves c at the first chunk of the tail. */
#define VNNI_INT4_RUNS                                                                                   \
    {                                                                                                    \
        const __m512i mask = _mm512_set1_epi8(0x0F);                                                     \
        const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);        \
        for (; c + 4 <= B; c += 4) {                                                                     \
            const int8_t *p = qx + c * BLOCK;                                                            \
            const __m512i xa = _mm512_loadu_si512((const void *)p), xb = _mm512_loadu_si512((const void *)(p + 64)); \
            const __m512i la = PL == 1 ? xa : _mm512_loadu_si512((const void *)(p + lo));               \
            const __m512i lb = PL == 1 ? xb : _mm512_loadu_si512((const void *)(p + lo + 64));          \
            const __m128 d4 = _mm_loadu_ps(dx + c);                                                      \
            for (int r = 0; r < NR; r++) {                                                               \
                const uint8_t *w = row + r * stride + c * (BLOCK / 2);                                   \
                STREAM_PREFETCH(w + DOT_PREFETCH_BYTES);                                                   \
                const __m512i bytes = _mm512_loadu_si512((const void *)w);                               \
                const __m512i low = _mm512_and_si512(bytes, mask);                                       \
                const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);                \
                __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), low, xa), high, xb); \
                if (PL == 2) d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(d, 7), low, la), high, lb); \
                const float *s = scale + r * G;                                                          \
                const __m128 s4 = group == BLOCK ? _mm_loadu_ps(s + c)                                   \
                                                 : _mm_setr_ps(s[cg[c]], s[cg[c + 1]], s[cg[c + 2]], s[cg[c + 3]]); \
                const __m512 k = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(s4, d4))); \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), k, acc[r]);                              \
            }                                                                                            \
        }                                                                                                \
    }
#define VNNI_NO_RUNS

/* One activation row (batch-1 decode) against NR weight rows at a time (rows `stride` bytes apart):
 * each row's arithmetic is NAME's above with MR = 1, but the NR rows' accumulator chains interleave
 * and share each activation load, where one row alone waits on its chain's FMA latency. RUNS: a lead
 * loop over the chunks that leaves the rest to these (VNNI_INT4_RUNS, or VNNI_NO_RUNS). */
#define DEFINE_ROWS_VNNI_M1(NAME, WEIGHT_T, ROW_BYTES, PREPARE, SIGNED, RUNS)                           \
    VNNI static inline __attribute__((always_inline)) void NAME(                                        \
        const WEIGHT_T *row, int64_t stride, const float *scale, const int8_t *qx, const float *dx,     \
        int64_t K, int64_t group, const int32_t *cg, float *out, const int NR, const float *offset,     \
        const float *xsum, int64_t lo, const int PL) {                                                  \
        const int64_t B = K / BLOCK, G = num_groups(K, group);                                           \
        __m512 acc[4];                                                                                   \
        for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();                                       \
        if (offset)                                                                                      \
            for (int64_t g = 0; g < G; g += 16) {                                                        \
                const __mmask16 k = G - g >= 16 ? 0xFFFF : (__mmask16)((1u << (G - g)) - 1);             \
                const __m512 xs = _mm512_maskz_loadu_ps(k, xsum + g);                                    \
                for (int r = 0; r < NR; r++)                                                             \
                    acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, offset + r * G + g), xs, acc[r]);  \
            }                                                                                            \
        int64_t c = 0;                                                                                   \
        RUNS                                                                                             \
        if (group == BLOCK) /* GGUF's blocks: each chunk its own scale, two a step read as one pair */   \
            for (; c + 1 < B; c += 2) {                                                                  \
                const __m512i xq = _mm512_loadu_si512((const void *)(qx + c * BLOCK));                   \
                const __m512i xl = PL == 1 ? xq : _mm512_loadu_si512((const void *)(qx + lo + c * BLOCK)); \
                const __m512 dxs = pair_lanes(dx + c);                                                   \
                for (int r = 0; r < NR; r++) {                                                           \
                    PREPARE(row + r * stride + c * (ROW_BYTES));                                         \
                    __m512i d = PLANES_DOT512(w, SIGNED, xq, xl);                                        \
                    const __m512 k = _mm512_mul_ps(pair_lanes(scale + r * G + c), dxs);                  \
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), k, acc[r]);                          \
                }                                                                                        \
            }                                                                                            \
        for (; c + 1 < B; c += 2) {                                                                      \
            const __m512i xq = _mm512_loadu_si512((const void *)(qx + c * BLOCK));                       \
            const __m512i xl = PL == 1 ? xq : _mm512_loadu_si512((const void *)(qx + lo + c * BLOCK));   \
            const __m512 dxs = lane_halves(dx[c], dx[c + 1]);                                                 \
            for (int r = 0; r < NR; r++) {                                                               \
                PREPARE(row + r * stride + c * (ROW_BYTES));                                             \
                __m512i d = PLANES_DOT512(w, SIGNED, xq, xl);                                            \
                const __m512 k = _mm512_mul_ps(chunk_pair_scales(scale + r * G, cg, c, group), dxs);      \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), k, acc[r]);                              \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < NR; r++) out[r] = _mm512_reduce_add_ps(acc[r]);                              \
        if (c < B) {                                                                                     \
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + c * BLOCK));                    \
            const __m256i xl = PL == 1 ? xq : _mm256_loadu_si256((const __m256i *)(qx + lo + c * BLOCK)); \
            for (int r = 0; r < NR; r++) {                                                               \
                PREPARE##_TAIL(row + r * stride + c * (ROW_BYTES));                                      \
                __m256i d = PLANES_DOT256_VNNI(wt, SIGNED##_TAIL, xq, xl);                               \
                out[r] += dx[c] * hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(d), chunk_scales(scale + r * G, cg, c, group))); \
            }                                                                                            \
        }                                                                                                \
    }

#define INT4_VNNI_PREPARE(p) const __m512i w = int4_codes2((const uint8_t *)(p))
#define INT4_VNNI_PREPARE_TAIL(p) const __m256i wt = int4_codes((const uint8_t *)(p))
#define AS_IS(xq) (xq)
#define AS_IS_TAIL(xq) (xq)
#define INT8_VNNI_PREPARE(p) STREAM_PREFETCH((const char *)(p) + DOT_PREFETCH_BYTES / 2); const __m512i wraw = _mm512_loadu_si512((const void *)(p)); \
    const __m512i w = _mm512_abs_epi8(wraw); const __mmask64 neg = _mm512_movepi8_mask(wraw)
#define INT8_VNNI_PREPARE_TAIL(p) const __m256i wraw_t = _mm256_loadu_si256((const __m256i *)(p)); \
    const __m256i wt = _mm256_sign_epi8(wraw_t, wraw_t)
#define NEGATED(xq) _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq)
#define NEGATED_TAIL(xq) _mm256_sign_epi8(xq, wraw_t)

DEFINE_ROW_VNNI(int4_row_vnni, uint8_t, BLOCK / 2, INT4_VNNI_PREPARE, AS_IS)
DEFINE_ROW_VNNI(int8_row_vnni, int8_t, BLOCK, INT8_VNNI_PREPARE, NEGATED)
DEFINE_ROWS_VNNI_M1(int4_rows_vnni_m1, uint8_t, BLOCK / 2, INT4_VNNI_PREPARE, AS_IS, VNNI_INT4_RUNS)
DEFINE_ROWS_VNNI_M1(int8_rows_vnni_m1, int8_t, BLOCK, INT8_VNNI_PREPARE, NEGATED, VNNI_NO_RUNS)

/* Rows n0 .. n1 - 1 into y[n - n0] for one activation row, STEP (1..4) weight rows at a time (ROWS: a
 * *_rows_*_m1). Measured with DRAM-resident weights: on AVX2 (Zen 3) INT4 gains from four rows sharing
 * each activation load and block scale, while INT8, whose chunks need no unpacking, loses (its four
 * interleaved streams run ~1.4x slower than one). On AVX-512 (Zen 5) four interleaved rows stream at
 * half the speed of one or two (INT4 gate_up, one thread: 15 vs 25-28 GB/s; the Q8_0 head 20 vs 27),
 * and two INT8 rows at half of one: so VNNI takes INT4 two rows at a time, INT8 one. */
#define M1_LOOP(ROWS, STEP, codes, row_bytes, scale, offset, G, y)                                        \
    do {                                                                                                 \
        int64_t n = n0;                                                                                  \
        for (; n + (STEP) <= n1; n += (STEP))                                                            \
            ROWS(codes + n * (row_bytes), row_bytes, scale + n * G, qx, dx, K, group, cg, y + n - n0, STEP, \
                 offset ? offset + n * G : NULL, xsum, K, PL);                                           \
        for (; n < n1; n++)                                                                              \
            ROWS(codes + n * (row_bytes), row_bytes, scale + n * G, qx, dx, K, group, cg, y + n - n0, 1,  \
                 offset ? offset + n * G : NULL, xsum, K, PL);                                           \
    } while (0)
#define AVX2_INT4_STEP 4
#define AVX2_INT8_STEP 1
#define VNNI_INT4_STEP 2
#define VNNI_INT8_STEP 1

static int use_vnni(void) {
    static int cached = -1;
    if (cached < 0)
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512vnni");
    return cached;
}

/* qx (one activation row) into `out` in the order the batch-1 INT4 rows take it (VNNI's or AVX2's). */
static inline void int4_m1_order(const int8_t *qx, int64_t K, int planes, int vnni, int8_t *out) {
    interleave_halves(qx, K, planes, vnni ? 4 : 2, out);
}

/* The group of each 32-element chunk: looked up in the inner loops, where dividing by a run-time
 * group size would cost an integer division per chunk. */
static inline int32_t *chunk_groups(int64_t K, int64_t group) {
    int32_t *cg = malloc(sizeof(int32_t) * (K / BLOCK));
    for (int64_t c = 0; c < K / BLOCK; c++) cg[c] = (int32_t)(c * BLOCK / group);
    return cg;
}
