/* Row kernels of the integer-dot low-bit matmul (method: lowbit_dot.c), shared by lowbit_dot.c and
 * decode_step.c. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define BLOCK 32

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

static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t group, int planes, int8_t *qx, float *dx,
                          float *xsum) {
    const int64_t G = num_groups(K, group);
    const float levels = planes == 2 ? Q16_LEVELS : Q8_LEVELS;
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        for (int64_t g = 0; g < G; g++) xsum[m * G + g] = 0.0f;
        for (int64_t b = 0; b < K / BLOCK; b++) {
            const float *xb = xr + b * BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
            const float inv = amax > 0.0f ? levels / amax : 0.0f;
            dx[m * (K / BLOCK) + b] = amax / levels;
            int8_t *hi = qx + m * K + b * BLOCK, *lo = hi + M * K;
            int32_t sum = 0;
            for (int i = 0; i < BLOCK; i++) {
                const int32_t q = (int32_t)nearbyintf(xb[i] * inv);
                if (planes == 2) hi[i] = (int8_t)(q >> 7), lo[i] = (int8_t)(q & 127);
                else hi[i] = (int8_t)q;
                sum += q;
            }
            xsum[m * G + b * BLOCK / group] += dx[m * (K / BLOCK) + b] * (float)sum;
        }
    }
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

static inline __m256i dot_u8s8(__m256i u, __m256i s) { /* 8 lanes, each the sum of 4 products */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* The integer dot of one chunk over PL planes: xq the high (or only) plane, xl the low one. */
#define PLANES_DOT256(DOT, xq, xl) (PL == 1 ? DOT(xq) : _mm256_add_epi32(_mm256_slli_epi32(DOT(xq), 7), DOT(xl)))

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
            const float s = scale[cg[c]];                                                    \
            DOT##_PREPARE(row + c * (ROW_BYTES));                                                        \
            for (int m = 0; m < MR; m++) {                                                               \
                const int8_t *p = qx + m * K + c * BLOCK;                                                \
                const __m256i xq = _mm256_loadu_si256((const __m256i *)p);                               \
                const __m256i xl = PL == 1 ? xq : _mm256_loadu_si256((const __m256i *)(p + lo));         \
                acc[m][c & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PLANES_DOT256(DOT, xq, xl)),          \
                                                _mm256_set1_ps(s * dx[m * B + c]), acc[m][c & 1]);       \
            }                                                                                            \
        }                                                                                                \
        for (int m = 0; m < MR; m++) {                                                                   \
            out[m] = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));                                          \
            if (offset) /* INT4's offset term */                                                         \
                for (int64_t g = 0; g < G; g++) out[m] += offset[g] * xsum[m * G + g];                   \
        }                                                                                                \
    }

#define INT4_AVX2_PREPARE(p) const __m256i w = int4_codes((const uint8_t *)(p))
#define INT4_AVX2(xq) dot_u8s8(w, xq)
#define INT8_AVX2_PREPARE(p) const __m256i w = _mm256_loadu_si256((const __m256i *)(p)); \
    const __m256i wabs = _mm256_sign_epi8(w, w)
#define INT8_AVX2(xq) dot_u8s8(wabs, _mm256_sign_epi8(xq, w))

DEFINE_ROW_AVX2(int4_row_avx2, uint8_t, BLOCK / 2, INT4_AVX2)
DEFINE_ROW_AVX2(int8_row_avx2, int8_t, BLOCK, INT8_AVX2)

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
            const float s0 = scale[cg[c]], s1 = scale[cg[c + 1]];             \
            PREPARE(row + c * (ROW_BYTES));                                                              \
            for (int m = 0; m < MR; m++) {                                                               \
                const int8_t *p = qx + m * K + c * BLOCK;                                                \
                const __m512i xq = _mm512_loadu_si512((const void *)p);                                  \
                const __m512i xl = PL == 1 ? xq : _mm512_loadu_si512((const void *)(p + lo));            \
                __m512i d = PLANES_DOT512(w, SIGNED, xq, xl);                                            \
                __m512 k = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0 * dx[m * B + c]),              \
                                                _mm512_set1_ps(s1 * dx[m * B + c + 1]));                 \
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), k, acc[m]);                              \
            }                                                                                            \
        }                                                                                                \
        for (int m = 0; m < MR; m++) out[m] = _mm512_reduce_add_ps(acc[m]);                              \
        if (c < B) { /* an odd chunk count: the last one at 256 bits */                                 \
            const float s = scale[cg[c]];                                                    \
            PREPARE##_TAIL(row + c * (ROW_BYTES));                                                       \
            for (int m = 0; m < MR; m++) {                                                               \
                const int8_t *p = qx + m * K + c * BLOCK;                                                \
                const __m256i xq = _mm256_loadu_si256((const __m256i *)p);                               \
                const __m256i xl = PL == 1 ? xq : _mm256_loadu_si256((const __m256i *)(p + lo));         \
                __m256i d = PLANES_DOT256_VNNI(wt, SIGNED##_TAIL, xq, xl);                               \
                out[m] += s * dx[m * B + c] * hsum(_mm256_cvtepi32_ps(d));                               \
            }                                                                                            \
        }                                                                                                \
    }

/* v[0], v[1] → lanes 0-7 v[0], lanes 8-15 v[1] (the scales of two chunks, beside their dpbusd lanes). */
VNNI static inline __m512 pair_lanes(const float *v) {
    const __m512 two = _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)v)));
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), two);
}

/* One activation row (batch-1 decode) against NR weight rows at a time (rows `stride` bytes apart):
 * each row's arithmetic is NAME's above with MR = 1, in the same order (so the same bits), but the
 * NR rows' accumulator chains interleave and share each activation load, where one row alone waits
 * on its chain's FMA latency. */
#define DEFINE_ROWS_VNNI_M1(NAME, WEIGHT_T, ROW_BYTES, PREPARE, SIGNED)                                 \
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
            const float d0 = dx[c], d1 = dx[c + 1];                                                      \
            for (int r = 0; r < NR; r++) {                                                               \
                const float s0 = scale[r * G + cg[c]], s1 = scale[r * G + cg[c + 1]];                    \
                PREPARE(row + r * stride + c * (ROW_BYTES));                                             \
                __m512i d = PLANES_DOT512(w, SIGNED, xq, xl);                                            \
                __m512 k = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0 * d0), _mm512_set1_ps(s1 * d1)); \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), k, acc[r]);                              \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < NR; r++) out[r] = _mm512_reduce_add_ps(acc[r]);                              \
        if (c < B) {                                                                                     \
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + c * BLOCK));                    \
            const __m256i xl = PL == 1 ? xq : _mm256_loadu_si256((const __m256i *)(qx + lo + c * BLOCK)); \
            for (int r = 0; r < NR; r++) {                                                               \
                const float s = scale[r * G + cg[c]];                                                    \
                PREPARE##_TAIL(row + r * stride + c * (ROW_BYTES));                                      \
                __m256i d = PLANES_DOT256_VNNI(wt, SIGNED##_TAIL, xq, xl);                               \
                out[r] += s * dx[c] * hsum(_mm256_cvtepi32_ps(d));                                       \
            }                                                                                            \
        }                                                                                                \
    }

#define INT4_VNNI_PREPARE(p) const __m512i w = int4_codes2((const uint8_t *)(p))
#define INT4_VNNI_PREPARE_TAIL(p) const __m256i wt = int4_codes((const uint8_t *)(p))
#define AS_IS(xq) (xq)
#define AS_IS_TAIL(xq) (xq)
#define INT8_VNNI_PREPARE(p) const __m512i wraw = _mm512_loadu_si512((const void *)(p)); \
    const __m512i w = _mm512_abs_epi8(wraw); const __mmask64 neg = _mm512_movepi8_mask(wraw)
#define INT8_VNNI_PREPARE_TAIL(p) const __m256i wraw_t = _mm256_loadu_si256((const __m256i *)(p)); \
    const __m256i wt = _mm256_sign_epi8(wraw_t, wraw_t)
#define NEGATED(xq) _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq)
#define NEGATED_TAIL(xq) _mm256_sign_epi8(xq, wraw_t)

DEFINE_ROW_VNNI(int4_row_vnni, uint8_t, BLOCK / 2, INT4_VNNI_PREPARE, AS_IS)
DEFINE_ROW_VNNI(int8_row_vnni, int8_t, BLOCK, INT8_VNNI_PREPARE, NEGATED)
DEFINE_ROWS_VNNI_M1(int4_rows_vnni_m1, uint8_t, BLOCK / 2, INT4_VNNI_PREPARE, AS_IS)
DEFINE_ROWS_VNNI_M1(int8_rows_vnni_m1, int8_t, BLOCK, INT8_VNNI_PREPARE, NEGATED)

/* Rows n0 .. n1 - 1 into y[n - n0] for one activation row, four weight rows at a time (ROWS: a *_rows_vnni_m1). */
#define VNNI_M1_LOOP(ROWS, codes, row_bytes, scale, offset, G, y)                                         \
    do {                                                                                                 \
        int64_t n = n0;                                                                                  \
        for (; n + 4 <= n1; n += 4)                                                                      \
            ROWS(codes + n * (row_bytes), row_bytes, scale + n * G, qx, dx, K, group, cg, y + n - n0, 4,       \
                 offset ? offset + n * G : NULL, xsum, K, PL);                                           \
        for (; n < n1; n++)                                                                              \
            ROWS(codes + n * (row_bytes), row_bytes, scale + n * G, qx, dx, K, group, cg, y + n - n0, 1,       \
                 offset ? offset + n * G : NULL, xsum, K, PL);                                           \
    } while (0)

static int use_vnni(void) {
    static int cached = -1;
    if (cached < 0)
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512vnni");
    return cached;
}

/* The group of each 32-element chunk: looked up in the inner loops, where dividing by a run-time
 * group size would cost an integer division per chunk. */
static inline int32_t *chunk_groups(int64_t K, int64_t group) {
    int32_t *cg = malloc(sizeof(int32_t) * (K / BLOCK));
    for (int64_t c = 0; c < K / BLOCK; c++) cg[c] = (int32_t)(c * BLOCK / group);
    return cg;
}
