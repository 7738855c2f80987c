/* Row kernels over ggml's own quantized blocks, read in place from the GGUF file's bytes (as ggml-cpu's
 * vec_dot functions do): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4. A weight row is
 * K / W blocks of the type's bytes (W = 32 weights, or 256 for the K-quants and IQ4_XS); nothing is unpacked to
 * memory.
 *
 * The activations are the integer-dot kernels' (lowbit_q8_rows.h: quantize_rows with groups of 32):
 * int8 codes in one plane, or 15-bit codes in two, dx per block of 32, xsum = dx * sum(codes) per block.
 * Each block's weights become unsigned bytes u (dpbusd's / maddubs' first operand) with
 *   w = scale * (u - zero)    zero a power of two: Q4_0 8, Q6_K 32, Q8_0 and the IQ4 / MXFP4 codebooks 128
 *                             (the signed code plus 128); its term is zero * the sum of each dot lane's
 *                             four activation codes (s4, once per activation row, negated), a shift and an add
 *                             (or, zero 128, the accumulator a dot product starts from);
 *   w = scale * u - min       Q4_K / Q5_K: the min meets xsum, as llama.cpp's Q8_K block sums.
 * So every type's dot is the same integer dot of codes against codes, exact, and the float work is one
 * multiply-add per sixteen lanes: y = sum over blocks of scale * dx * <u - zero, qx> (- min * xsum).
 *
 * VNNI (AVX512-VNNI, chosen at run time): two blocks of 32 per _mm512_dpbusd_epi32 (Q4_K, Q5_K, IQ4_XS: against a
 * copy of the activation codes in the order their 64-byte code loads hold the weights, ggml_vnni_order). AVX2: four
 * blocks of 32 a step in registers (Avx2Quad), maddubs (the sign trick for signed codes); for a batch, panels of eight rows
 * unpacked side by side (ggml_panels_avx2; on VNNI without AMX, two at a time by dpbusd: ggml_panels_vnni).
 * ggml_unpack (a block to signed codes in memory) serves the panels and a batch's float tiles. The portable path
 * and the reference in the tests dequantize in PyTorch (gguf_quants.py). */
#pragma once
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lowbit_q8_rows.h"

/* A thread's scratch memory of one kind, kept for its next call and freed when the thread exits: memory fresh from
 * the allocator on every call costs a page fault per 4 KiB, each a TLB shootdown on the other cores. */
enum { KEPT_AMX_ACCUMULATORS, KEPT_ORDERED, KEPT_KINDS };
static pthread_key_t kept_keys[KEPT_KINDS];
static void kept_keys_create(void) {
    for (int i = 0; i < KEPT_KINDS; i++) pthread_key_create(&kept_keys[i], free);
}
static void *thread_kept(int kind, int64_t bytes) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    static __thread void *kept[KEPT_KINDS];
    static __thread int64_t capacity[KEPT_KINDS];
    if (bytes > capacity[kind]) {
        pthread_once(&once, kept_keys_create);
        free(kept[kind]);
        kept[kind] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        capacity[kind] = bytes;
        pthread_setspecific(kept_keys[kind], kept[kind]);
    }
    return kept[kind];
}

/* ggml_type's numbers, as the GGUF file stores them. */
enum {
    GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12,
    GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_NL = 20, GGML_IQ4_XS = 23, GGML_BF16 = 30, GGML_MXFP4 = 39
};

#define QK_K 256
#define GGML_CHUNK 1024 /* weights of each row a VNNI tile takes at a time (a multiple of every block's) */

static inline int ggml_supported(int64_t t) {
    return t == GGML_Q4_0 || t == GGML_Q4_1 || t == GGML_Q5_0 || t == GGML_Q5_1 || t == GGML_Q8_0 || t == GGML_Q2_K ||
           t == GGML_Q3_K || t == GGML_Q4_K || t == GGML_Q5_K || t == GGML_Q6_K || t == GGML_IQ4_NL || t == GGML_IQ4_XS ||
           t == GGML_MXFP4 || t == GGML_F16 || t == GGML_BF16;
}
/* float16 / bfloat16: rows of floats, met by the float activations themselves (ggml_float_slice), in blocks of 32. */
static inline int ggml_half(int64_t t) { return t == GGML_F16 || t == GGML_BF16; }
/* The types with VNNI rows and AMX tiles of their own; Q2_K and Q3_K take the AVX2 rows and panels everywhere. */
static inline int ggml_wide_isas(int64_t t) { return t != GGML_Q2_K && t != GGML_Q3_K && !ggml_half(t); }
/* The types whose AVX2 rows meet the activations' sums per 16 (GGMLActs.xsum16): a min or zero point per 16. */
static inline int ggml_sums16(int64_t t) { return t == GGML_Q2_K || t == GGML_Q3_K || t == GGML_Q6_K; }
static inline int64_t ggml_block_weights(int64_t t) {
    return t == GGML_Q2_K || t == GGML_Q3_K || t == GGML_Q4_K || t == GGML_Q5_K || t == GGML_Q6_K || t == GGML_IQ4_XS ? QK_K : 32;
}
static inline int64_t ggml_block_bytes(int64_t t) {
    switch (t) {
    case GGML_Q4_0: case GGML_IQ4_NL: return 18;
    case GGML_MXFP4: return 17;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_F16: case GGML_BF16: return 64;
    case GGML_Q2_K: return 84;
    case GGML_Q3_K: return 110;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 136; /* IQ4_XS */
    }
}
static inline int64_t ggml_row_bytes(int64_t t, int64_t K) { return K / ggml_block_weights(t) * ggml_block_bytes(t); }

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* ggml's kvalues_iq4nl, plus 128: the IQ4 codebooks as unsigned bytes. */
static const uint8_t IQ4_U8[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
/* ggml's kvalues_mxfp4 (FP4 E2M1's values doubled), plus 128. */
static const uint8_t MXFP4_U8[16] = {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116};

/* MXFP4: the E8M0 exponent e at p as ggml's GGML_E8M0_TO_FP32_HALF, 2^(e - 128) exactly (e < 2: a subnormal). */
static inline float e8m0_at(const uint8_t *p) {
    const uint32_t bits = *p < 2 ? 0x00200000u << *p : (uint32_t)(*p - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* IQ4_XS: the eight sub-blocks' scales d * (ls - 32), ls 6 bits: low nibbles at q + 2, high pairs in q[0..1]. */
static inline void iq4_xs_scales(const uint8_t *b, float *sc) {
    const float d = f16_at(b);
    uint16_t high;
    memcpy(&high, b + 2, 2);
    for (int i = 0; i < 8; i++) {
        const int ls = ((b[4 + i / 2] >> (4 * (i % 2))) & 0xF) | (((high >> (2 * i)) & 3) << 4);
        sc[i] = d * (float)(ls - 32);
    }
}

/* Q3_K: the 12 bytes of sixteen 6-bit scales → int8 scale - 32, in order. Scale i's low nibble is byte i's low one
 * (i < 8) or byte i - 8's high one; its high pair, bits 2 (i / 4) of byte 8 + i % 4. */
static inline __m128i q3_k_scales(const uint8_t *q) {
    uint32_t a[3];
    memcpy(a, q, 12);
    const uint32_t low = 0x0f0f0f0f, two = 0x03030303;
    const __m128i s = _mm_setr_epi32((int)((a[0] & low) | ((a[2] & two) << 4)), (int)((a[1] & low) | (((a[2] >> 2) & two) << 4)),
                                     (int)(((a[0] >> 4) & low) | (((a[2] >> 4) & two) << 4)),
                                     (int)(((a[1] >> 4) & low) | (((a[2] >> 6) & two) << 4)));
    return _mm_sub_epi8(s, _mm_set1_epi8(32));
}

/* Q2_K / Q3_K: block j of 32 (0..7) of a super-block's 2-bit quants at qs: bits 2 (j % 4) of bytes 32 (j / 4) ..
 * + 31, as codes 0..3. */
static inline __m256i two_bit_block(const uint8_t *qs, int j) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 4)));
    return _mm256_and_si256(_mm256_srli_epi16(q, 2 * (j % 4)), _mm256_set1_epi8(3));
}

/* Q3_K: block j's unsigned codes u (0..7; the weight's code is u - 4): its 2-bit quants, plus 4 where bit j of the
 * 32 high-bit bytes at b is set (that bit shifted to bit 2 of its byte). */
static inline __m256i q3_k_block(const uint8_t *b, int j) {
    const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
    const __m256i high = j >= 2 ? _mm256_srli_epi16(hm, j - 2) : _mm256_slli_epi16(hm, 2 - j);
    return _mm256_or_si256(two_bit_block(b + 32, j), _mm256_and_si256(high, _mm256_set1_epi8(4)));
}

/* The zero point's shift (zero = 1 << shift), -1 for the min types. */
static inline int ggml_zero_shift(int64_t t) {
    switch (t) {
    case GGML_Q4_0: return 3;
    case GGML_Q5_0: return 4;
    case GGML_Q3_K: return 2;
    case GGML_Q6_K: return 5;
    case GGML_Q4_1: case GGML_Q5_1: case GGML_Q2_K: case GGML_Q4_K: case GGML_Q5_K: return -1;
    default: return 7;
    }
}

/* s4[m, i] = minus the sum of activation codes 4i .. 4i + 3 of row m (15-bit codes: 128 * high plane + low):
 * negated, so that it can start a dot product's accumulator (VNNI_PAIR_SCALED). */
static inline void activation_sums4(const int8_t *qx, int64_t M, int64_t K, int PL, int32_t *s4) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < K / 4; i++) {
            const int8_t *h = qx + m * K + 4 * i;
            int32_t s = (int32_t)h[0] + h[1] + h[2] + h[3];
            if (PL == 2) {
                const int8_t *l = h + M * K;
                s = 128 * s + l[0] + l[1] + l[2] + l[3];
            }
            s4[m * (K / 4) + i] = -s;
        }
}

/* Q4_K / Q5_K: the 12 bytes of 6-bit scales and mins at q as bytes 0-7 (scales) and 8-15 (mins), in vector
 * registers (the scalar shifts and masks through memory were a third of the VNNI rows' instructions). Scale j < 4 is
 * q[j] & 63 and min j < 4 q[4 + j] & 63; scale j >= 4 is q[4 + j]'s low nibble and min j >= 4 its high one, each with
 * bits 6-7 of q[j - 4] (scales) or q[j] (mins) above. Reads 16 bytes at q: in a super-block the codes follow. */
static inline __m128i k_scale_bytes(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q);
    const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i tops = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i nibbles = _mm_blend_epi32(low, _mm_srli_epi16(low, 4), 8); /* lanes 12-15: the high nibbles */
    const __m128i masks = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    return _mm_or_si128(_mm_and_si128(nibbles, masks), _mm_and_si128(_mm_srli_epi16(tops, 2), _mm_set1_epi8(0x30)));
}

/* Prefetch a super-block's bytes, `ahead` bytes on. */
#define PREFETCH_SUPER(b, S)                                                                                       \
    for (int l_ = 0; l_ < (S); l_ += 64) _mm_prefetch((const char *)(b) + ahead + l_, _MM_HINT_T0)

/* Q6_K's half h of a super-block (128 weights) as four blocks of 32 unsigned codes u (0..63; the weight's code is
 * u - 32): 64 bytes of low nibbles (A, B) and 32 of high pairs (H) make A & 15 | H0 << 4, B & 15 | H1 << 4,
 * A >> 4 | H2 << 4, B >> 4 | H3 << 4, 32 weights of each quarter at a time (the AVX2 rows' quads, ggml_unpack). */
static inline void q6_k_quarters_of(__m256i a, __m256i c, __m256i hi, __m256i *u) {
    const __m256i low = _mm256_set1_epi8(0xF), two = _mm256_set1_epi8(0x30);
    u[0] = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(hi, 4), two));
    u[1] = _mm256_or_si256(_mm256_and_si256(c, low), _mm256_and_si256(_mm256_slli_epi16(hi, 2), two));
    u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(hi, two));
    u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low), _mm256_and_si256(_mm256_srli_epi16(hi, 2), two));
}
static inline void q6_k_quarters(const uint8_t *b, int h, __m256i *u) {
    q6_k_quarters_of(_mm256_loadu_si256((const __m256i *)(b + 64 * h)), _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)),
                     _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), u);
}

/* ---- AVX2: four blocks of 32 at a time, straight from the file's bytes ---------------------------- */

/* Four consecutive blocks of 32 weights in registers. u[i]: block i's 32 codes as maddubs' unsigned operand —
 * the codes themselves, or |w| for the signed types (SIGNED below), whose activations then take w[i]'s sign;
 * ws: the blocks' float scales; mins: their terms against xsum. Block i's dot with an activation block (codes q,
 * step dx, xsum): ws[i] * dx * <u[i], q> - mins[i] * xsum. The types of 16-weight sub-blocks (Q2_K, Q3_K, Q6_K:
 * MIN 2) have a scale and a min (Q2_K) or zero point's term (Q3_K 4, Q6_K 32: d sc (u - z) = d sc u - z d sc) per
 * 16 weights instead: ws16, in the lanes the quad's sums reach (quad_lanes), and mins16 against the activations'
 * sums of 16 (xsum16). */
typedef struct {
    __m256i u[4], w[4];
    __m128 ws, mins;
    __m256 ws16, mins16;
} Avx2Quad;

/* Four floats at p, or the first n of them and zeros (the rest never read: a row's last blocks). */
static inline __attribute__((always_inline)) __m256 avx2_quad_floats(const float *p, const int n) {
    if (n == 4) return _mm256_broadcast_ps((const __m128 *)p);
    const __m128 v = _mm_maskload_ps(p, _mm_cmpgt_epi32(_mm_set1_epi32(n), _mm_setr_epi32(0, 1, 2, 3)));
    return _mm256_set_m128(v, v);
}

/* acc[m] += the quad's dots with activation row m, blocks c .. c + n - 1 of the row (n = 4 but at a row's
 * end: the last one to three blocks, whose missing activations read as zero). The four blocks' eight-lane
 * integer dots reduce to one vector (two horizontal adds: lane i and 4 + i hold block i's halves), so the
 * float work is one convert and two multiply-adds a quad rather than a block. */
static inline __attribute__((always_inline)) void avx2_quad(const Avx2Quad *q, int64_t c, const int8_t *qx,
                                                            const float *dx, const float *xsum, int64_t K, int64_t lo,
                                                            __m256 *acc, const int MR, const int PL, const int SIGNED,
                                                            const int MIN, const int n) {
    const int64_t B = K / BLOCK;
    const __m256 ws = MIN == 2 ? q->ws16 : _mm256_set_m128(q->ws, q->ws);
    const __m256 mins = MIN == 1 ? _mm256_set_m128(_mm_setzero_ps(), q->mins) : _mm256_setzero_ps();
    for (int m = 0; m < MR; m++) {
        const int8_t *p = qx + m * K + c * BLOCK;
        __m256i d[4];
        for (int i = 0; i < 4; i++) {
            if (i >= n) {
                d[i] = _mm256_setzero_si256();
                continue;
            }
            const __m256i x = _mm256_loadu_si256((const __m256i *)(p + BLOCK * i));
            d[i] = dot_u8s8(q->u[i], SIGNED ? _mm256_sign_epi8(x, q->w[i]) : x, PL == 1 ? ONES16 : HIGH16);
            if (PL == 2) { /* the low plane's codes are unsigned: no sign trick */
                const __m256i xl = _mm256_loadu_si256((const __m256i *)(p + lo + BLOCK * i));
                d[i] = _mm256_add_epi32(d[i], SIGNED ? dot_u8s8(xl, q->w[i], ONES16) : dot_u8s8(q->u[i], xl, ONES16));
            }
        }
        const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
        const __m256 k = _mm256_mul_ps(ws, avx2_quad_floats(dx + m * B + c, n));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), k, acc[m]);
        if (MIN == 1) acc[m] = _mm256_fnmadd_ps(mins, avx2_quad_floats(xsum + m * B + c, n), acc[m]);
        if (MIN == 2) acc[m] = _mm256_fnmadd_ps(q->mins16, _mm256_loadu_ps(xsum + m * (K / 16) + 2 * c), acc[m]);
    }
}

/* The float16s at b, b + S, b + 2S, b + 3S (four blocks' scales or mins). */
static inline __m128 f16_quad(const uint8_t *b, int64_t S) {
    uint16_t h[4];
    for (int i = 0; i < 4; i++) memcpy(h + i, b + i * S, 2);
    return _mm_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0, 0, 0, 0));
}

/* Q5_0 / Q5_1: a block's 32 fifth bits (bit j: weight j) as 16 in the bytes whose bit is set. */
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

/* A 16-entry codebook (IQ4_U8, MXFP4_U8) as signed values in each 128-bit lane, for shuffle_epi8. */
static inline __m256i signed_book(const uint8_t *book) {
    return _mm256_xor_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)book)), _mm256_set1_epi8((char)0x80));
}

/* Signed codes w: u = |w|, the sign trick's. */
static inline void quad_signed(Avx2Quad *q) {
    for (int i = 0; i < 4; i++) q->u[i] = _mm256_sign_epi8(q->w[i], q->w[i]);
    q->mins = _mm_setzero_ps();
}

/* Sixteen bytes of nibbles at p looked up in a codebook (signed_book's): 32 signed codes, in element order. */
static inline __m256i book_codes(__m256i book, const uint8_t *p) { return _mm256_shuffle_epi8(book, int4_codes(p)); }

/* One block of a 32-weight type at b as maddubs' codes, the quads' u for the unsigned types (Q4_0, Q4_1, Q5_0,
 * Q5_1: u, the weight's code u - zero or u against a min) and their w for the signed ones (Q8_0 and the codebooks:
 * the weight's code itself). */
static inline __attribute__((always_inline)) __m256i block32_codes(int64_t t, const uint8_t *b) {
    switch (t) {
    case GGML_Q4_0: return int4_codes(b + 2);
    case GGML_Q4_1: return int4_codes(b + 4);
    case GGML_Q5_0: return _mm256_or_si256(int4_codes(b + 6), fifth_bits(b + 2));
    case GGML_Q5_1: return _mm256_or_si256(int4_codes(b + 8), fifth_bits(b + 4));
    case GGML_Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case GGML_IQ4_NL: return book_codes(signed_book(IQ4_U8), b + 2);
    default: return book_codes(signed_book(MXFP4_U8), b + 1); /* MXFP4 */
    }
}

/* The 32-weight types' quads: four blocks of S bytes at b. */
static inline void q4_0_quad(const uint8_t *b, Avx2Quad *q) {
    for (int i = 0; i < 4; i++) q->u[i] = block32_codes(GGML_Q4_0, b + 18 * i);
    q->ws = f16_quad(b, 18), q->mins = _mm_mul_ps(q->ws, _mm_set1_ps(8));
}
static inline void q4_1_quad(const uint8_t *b, Avx2Quad *q) {
    for (int i = 0; i < 4; i++) q->u[i] = block32_codes(GGML_Q4_1, b + 20 * i);
    q->ws = f16_quad(b, 20), q->mins = _mm_sub_ps(_mm_setzero_ps(), f16_quad(b + 2, 20));
}
static inline void q5_0_quad(const uint8_t *b, Avx2Quad *q) {
    for (int i = 0; i < 4; i++) q->u[i] = block32_codes(GGML_Q5_0, b + 22 * i);
    q->ws = f16_quad(b, 22), q->mins = _mm_mul_ps(q->ws, _mm_set1_ps(16));
}
static inline void q5_1_quad(const uint8_t *b, Avx2Quad *q) {
    for (int i = 0; i < 4; i++) q->u[i] = block32_codes(GGML_Q5_1, b + 24 * i);
    q->ws = f16_quad(b, 24), q->mins = _mm_sub_ps(_mm_setzero_ps(), f16_quad(b + 2, 24));
}
static inline void q8_0_quad(const uint8_t *b, Avx2Quad *q) {
    for (int i = 0; i < 4; i++) q->w[i] = block32_codes(GGML_Q8_0, b + 34 * i);
    quad_signed(q), q->ws = f16_quad(b, 34);
}
static inline void iq4_nl_quad(const uint8_t *b, Avx2Quad *q) {
    for (int i = 0; i < 4; i++) q->w[i] = block32_codes(GGML_IQ4_NL, b + 18 * i);
    quad_signed(q), q->ws = f16_quad(b, 18);
}
static inline void mxfp4_quad(const uint8_t *b, Avx2Quad *q) {
    for (int i = 0; i < 4; i++) q->w[i] = block32_codes(GGML_MXFP4, b + 17 * i);
    quad_signed(q), q->ws = _mm_setr_ps(e8m0_at(b), e8m0_at(b + 17), e8m0_at(b + 34), e8m0_at(b + 51));
}

#define AVX2_ROW_ARGS                                                                                              \
    const uint8_t *row, const int8_t *qx, const float *dx, const float *xsum, int64_t K, int64_t k0, int64_t k1,   \
        int64_t lo, int64_t ahead, float *out, const int MR, const int PL
#define AVX2_ROW(NAME) static inline __attribute__((always_inline)) void NAME(AVX2_ROW_ARGS)
#define AVX2_ROW_BEGIN                                                                                             \
    __m256 acc[8];                                                                                                 \
    for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
#define AVX2_ROW_END for (int m = 0; m < MR; m++) out[m] = hsum(acc[m]);

/* The 32-weight types: quads, then the last one to three blocks as a quad of their own (copied beside zero
 * blocks, so that no load runs past the row; their missing activations read as zero: avx2_quad's n). */
#define DEFINE_AVX2_ROW32(NAME, TYPE, QUAD, SIGNED, MIN)                                                             \
    AVX2_ROW(NAME) {                                                                                               \
        const int64_t S = ggml_block_bytes(TYPE);                                                                  \
        AVX2_ROW_BEGIN                                                                                             \
        int64_t c = k0 / BLOCK;                                                                                    \
        for (; c + 4 <= k1 / BLOCK; c += 4) {                                                                      \
            const uint8_t *b = row + c * S;                                                                        \
            for (int64_t l = 0; l < 4 * S; l += 64) _mm_prefetch((const char *)b + ahead + l, _MM_HINT_T0);        \
            Avx2Quad q;                                                                                            \
            QUAD(b, &q);                                                                                           \
            avx2_quad(&q, c, qx, dx, xsum, K, lo, acc, MR, PL, SIGNED, MIN, 4);                                 \
        }                                                                                                          \
        if (c < k1 / BLOCK) {                                                                                      \
            uint8_t tail[4 * 34] = {0};                                                                            \
            memcpy(tail, row + c * S, (size_t)((k1 / BLOCK - c) * S));                                             \
            Avx2Quad q;                                                                                            \
            QUAD(tail, &q);                                                                                        \
            avx2_quad(&q, c, qx, dx, xsum, K, lo, acc, MR, PL, SIGNED, MIN, (int)(k1 / BLOCK - c));             \
        }                                                                                                          \
        AVX2_ROW_END                                                                                               \
    }
DEFINE_AVX2_ROW32(ggml_row_avx2_q4_0, GGML_Q4_0, q4_0_quad, 0, 1)
DEFINE_AVX2_ROW32(ggml_row_avx2_q4_1, GGML_Q4_1, q4_1_quad, 0, 1)
DEFINE_AVX2_ROW32(ggml_row_avx2_q5_0, GGML_Q5_0, q5_0_quad, 0, 1)
DEFINE_AVX2_ROW32(ggml_row_avx2_q5_1, GGML_Q5_1, q5_1_quad, 0, 1)
DEFINE_AVX2_ROW32(ggml_row_avx2_q8_0, GGML_Q8_0, q8_0_quad, 1, 0)
DEFINE_AVX2_ROW32(ggml_row_avx2_iq4_nl, GGML_IQ4_NL, iq4_nl_quad, 1, 0)
DEFINE_AVX2_ROW32(ggml_row_avx2_mxfp4, GGML_MXFP4, mxfp4_quad, 1, 0)

/* The 256-weight types: two quads a super-block of S bytes, SCALES decoded once for both (into locals QUAD
 * reads; h the quad, 0 or 1). */
#define DEFINE_AVX2_ROW_K(NAME, S, SCALES, QUAD, SIGNED, MIN)                                                        \
    AVX2_ROW(NAME) {                                                                                               \
        AVX2_ROW_BEGIN                                                                                             \
        for (int64_t sb = k0 / QK_K; sb < k1 / QK_K; sb++) {                                                       \
            const uint8_t *b = row + sb * (S);                                                                     \
            PREFETCH_SUPER(b, S);                                                                                  \
            SCALES                                                                                                 \
            for (int h = 0; h < 2; h++) {                                                                          \
                Avx2Quad q;                                                                                        \
                QUAD;                                                                                              \
                avx2_quad(&q, sb * 8 + 4 * h, qx, dx, xsum, K, lo, acc, MR, PL, SIGNED, MIN, 4);                      \
            }                                                                                                      \
        }                                                                                                          \
        AVX2_ROW_END                                                                                               \
    }

/* Lanes 4h .. 4h + 3 of eight floats. */
static inline __m128 half_of(__m256 v, int h) { return h ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v); }

/* Q4_K / Q5_K: the super-block's eight sub-block scales and mins (d * scale, dmin * min). */
#define K_SCALES                                                                                                   \
    const __m128i packed_ = k_scale_bytes(b + 4);                                                                  \
    const __m256 sc8 = _mm256_mul_ps(_mm256_set1_ps(f16_at(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed_)));  \
    const __m256 mn8 = _mm256_mul_ps(_mm256_set1_ps(f16_at(b + 2)),                                                \
                                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed_, 8))));

/* Q5_K: sub-block p's fifth bits (bit p of each byte of `bits`) as bit 4 of each byte: within the byte for shifts
 * of at most 4 left, 3 right. */
static inline __m256i q5_k_fifth(__m256i bits, int p) {
    const __m256i moved = p <= 4 ? _mm256_slli_epi16(bits, 4 - p) : _mm256_srli_epi16(bits, p - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8(16));
}

/* Q4_K / Q5_K: sub-blocks 4h .. 4h + 3 as unsigned codes u, the low and high nibbles of 32 bytes each at qs + 64h
 * (+ 32); Q5_K's fifth bits (fifth != NULL): bit 4h + i of its 32 bytes for sub-block 4h + i. */
static inline __attribute__((always_inline)) void k_quad_codes(const uint8_t *qs, const uint8_t *fifth, int h, __m256i *u) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 2; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * h + 32 * j));
        u[2 * j] = _mm256_and_si256(v, low), u[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    if (fifth) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)fifth);
        for (int i = 0; i < 4; i++) u[i] = _mm256_or_si256(u[i], q5_k_fifth(bits, 4 * h + i));
    }
}

/* Q4_K / Q5_K quad h: k_quad_codes, with the sub-blocks' scales and mins (K_SCALES' sc8, mn8). */
static inline void k_quad(const uint8_t *qs, const uint8_t *fifth, int h, __m256 sc8, __m256 mn8, Avx2Quad *q) {
    k_quad_codes(qs, fifth, h, q->u);
    q->ws = half_of(sc8, h), q->mins = half_of(mn8, h);
}

/* Eight values of a quad's sub-blocks of 16 (in order) → the lanes its sums reach after avx2_quad's horizontal
 * adds: block i's first sixteen weights in lane i, its last sixteen in lane 4 + i. */
static inline __m256i quad_lanes(__m256i v) { return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)); }

/* Q6_K quad h (q6_k_quarters' unsigned codes u, the weight's code u - 32); the int8 sub-block scales times d per 16
 * weights and the zero point's term 32 d sc (MIN 2). */
static inline void q6_k_quad(const uint8_t *b, int h, Avx2Quad *q) {
    q6_k_quarters(b, h, q->u);
    const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 192 + 8 * h))); /* scales 8h .. 8h + 7 */
    const float d = f16_at(b + 208);
    q->ws16 = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(quad_lanes(sc)));
    q->mins16 = _mm256_mul_ps(_mm256_set1_ps(32 * d), _mm256_cvtepi32_ps(sc));
}

/* Q3_K quad h (blocks 4h .. 4h + 3): unsigned codes u, the sub-block scales d sc (Q3_SCALES: the super-block's
 * sixteen int8 sc) per 16 weights and the zero point's term 4 d sc (MIN 2). */
#define Q3_SCALES const __m128i sc3 = q3_k_scales(b + 96);
static inline void q3_k_quad(const uint8_t *b, int h, __m128i sc3, Avx2Quad *q) {
    for (int i = 0; i < 4; i++) q->u[i] = q3_k_block(b, 4 * h + i);
    const __m256i sc = _mm256_cvtepi8_epi32(h ? _mm_unpackhi_epi64(sc3, sc3) : sc3); /* scales 8h .. 8h + 7 */
    const float d = f16_at(b + 108);
    q->ws16 = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(quad_lanes(sc)));
    q->mins16 = _mm256_mul_ps(_mm256_set1_ps(4 * d), _mm256_cvtepi32_ps(sc));
}

/* Q2_K quad h: codes 0..3, the 4-bit sub-block scales (low nibbles of bytes 8h .. 8h + 7) times d per 16 weights
 * and the mins (high nibbles) times dmin (MIN 2). */
static inline void q2_k_quad(const uint8_t *b, int h, Avx2Quad *q) {
    for (int i = 0; i < 4; i++) q->u[i] = two_bit_block(b + 16, 4 * h + i);
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * h))), nibble = _mm256_set1_epi32(0xF);
    q->ws16 = _mm256_mul_ps(_mm256_set1_ps(f16_at(b + 80)), _mm256_cvtepi32_ps(quad_lanes(_mm256_and_si256(bytes, nibble))));
    q->mins16 = _mm256_mul_ps(_mm256_set1_ps(f16_at(b + 82)), _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)));
}

/* IQ4_XS quad h: sub-blocks 4h .. 4h + 3 (16 bytes of nibbles each at b + 8, IQ4_NL's), codebook values. */
static inline void iq4_xs_quad(const uint8_t *b, int h, __m256 sc8, Avx2Quad *q) {
    const __m256i book = signed_book(IQ4_U8);
    for (int i = 0; i < 4; i++) q->w[i] = book_codes(book, b + 8 + 16 * (4 * h + i));
    quad_signed(q), q->ws = half_of(sc8, h);
}

DEFINE_AVX2_ROW_K(ggml_row_avx2_q4_k, 144, K_SCALES, k_quad(b + 16, NULL, h, sc8, mn8, &q), 0, 1)
DEFINE_AVX2_ROW_K(ggml_row_avx2_q5_k, 176, K_SCALES, k_quad(b + 48, b + 16, h, sc8, mn8, &q), 0, 1)
DEFINE_AVX2_ROW_K(ggml_row_avx2_q6_k, 210, , q6_k_quad(b, h, &q), 0, 2)
DEFINE_AVX2_ROW_K(ggml_row_avx2_q3_k, 110, Q3_SCALES, q3_k_quad(b, h, sc3, &q), 0, 2)
DEFINE_AVX2_ROW_K(ggml_row_avx2_q2_k, 84, , q2_k_quad(b, h, &q), 0, 2)
DEFINE_AVX2_ROW_K(ggml_row_avx2_iq4_xs, 136, float sc_[8]; iq4_xs_scales(b, sc_); const __m256 sc8 = _mm256_loadu_ps(sc_);,
                  iq4_xs_quad(b, h, sc8, &q), 1, 0)

/* ---- a block unpacked to signed codes (the panels, a batch's float tiles) ---------------------------- */

/* One block of type t (W weights) → codes int8 [W] (u - zero, or u for the min types), scales float [W / 16]
 * (one per 16 weights), mins float [W / 32] (the min types; else zeros) — Q2_K's [W / 16], a min per 16. The
 * codes come from the AVX2 rows' own producers, 32 at a time (a scalar loop made batches unpack-bound). */
static inline void ggml_unpack(int64_t t, const uint8_t *b, int8_t *codes, float *s16, float *m32) {
    switch (t) {
    case GGML_Q2_K: {
        const float d = f16_at(b + 80), dmin = f16_at(b + 82);
        for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(codes + 32 * j), two_bit_block(b + 16, j));
        for (int i = 0; i < 16; i++) s16[i] = d * (float)(b[i] & 0xF), m32[i] = dmin * (float)(b[i] >> 4);
        return;
    }
    case GGML_Q3_K: {
        int8_t sc[16];
        _mm_storeu_si128((__m128i *)sc, q3_k_scales(b + 96));
        for (int j = 0; j < 8; j++)
            _mm256_storeu_si256((__m256i *)(codes + 32 * j), _mm256_sub_epi8(q3_k_block(b, j), _mm256_set1_epi8(4)));
        for (int i = 0; i < 16; i++) s16[i] = f16_at(b + 108) * (float)sc[i];
        for (int i = 0; i < 8; i++) m32[i] = 0;
        return;
    }
    case GGML_Q4_K: case GGML_Q5_K: {
        const int q5 = t == GGML_Q5_K;
        K_SCALES /* the rows' and tiles' own decode of the twelve scale bytes */
        float sc[8];
        _mm256_storeu_ps(sc, sc8), _mm256_storeu_ps(m32, mn8);
        for (int h = 0; h < 2; h++) {
            __m256i u[4];
            k_quad_codes(b + (q5 ? 48 : 16), q5 ? b + 16 : NULL, h, u);
            for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(codes + 128 * h + 32 * i), u[i]);
        }
        for (int i = 0; i < 16; i++) s16[i] = sc[i / 2];
        return;
    }
    case GGML_Q6_K: {
        const float d = f16_at(b + 208);
        for (int h = 0; h < 2; h++) {
            __m256i u[4];
            q6_k_quarters(b, h, u);
            for (int p = 0; p < 4; p++)
                _mm256_storeu_si256((__m256i *)(codes + 128 * h + 32 * p), _mm256_sub_epi8(u[p], _mm256_set1_epi8(32)));
        }
        for (int i = 0; i < 16; i++) s16[i] = d * (float)(int8_t)b[192 + i];
        for (int i = 0; i < 8; i++) m32[i] = 0;
        return;
    }
    case GGML_IQ4_XS: {
        float sc[8];
        iq4_xs_scales(b, sc);
        const __m256i book = signed_book(IQ4_U8);
        for (int i = 0; i < 8; i++) {
            _mm256_storeu_si256((__m256i *)(codes + 32 * i), book_codes(book, b + 8 + 16 * i));
            s16[2 * i] = s16[2 * i + 1] = sc[i], m32[i] = 0;
        }
        return;
    }
    default: { /* the 32-weight types: Q4_0 and Q5_0 less their zero point; the min types' mins negated */
        const int zs = ggml_zero_shift(t), min = zs < 0;
        const __m256i zero = _mm256_set1_epi8(zs == 3 || zs == 4 ? (char)(1 << zs) : 0);
        _mm256_storeu_si256((__m256i *)codes, _mm256_sub_epi8(block32_codes(t, b), zero));
        s16[0] = s16[1] = t == GGML_MXFP4 ? e8m0_at(b) : f16_at(b), m32[0] = min ? -f16_at(b + 2) : 0;
        return;
    }
    }
}

/* ---- AVX512-VNNI: two blocks of 32 a dpbusd, straight from the file's bytes ----------------------- */

/* acc[m] += the pair of blocks (c, c + 1)'s dot: w their 64 unsigned codes, KM (an expression of m) its sixteen
 * lanes' multipliers for activation row m (weight scale x dx); ZS the zero point's shift (-1: none). The zero
 * point's term, -(s4 << ZS), starts the accumulator where it can: the first product's for int8 activations, and
 * for 15-bit ones with zero 128 (ZS 7: Q8_0, the IQ4 codebooks, MXFP4) the high plane's, before its shift by 7
 * (2^7 (hi·u - s4) + lo·u = x·u - 2^7 s4) — two fewer instructions a pair where the 4-bit rows are
 * instruction-bound. */
#define VNNI_PAIR_SCALED(w, KM, c, ZS) VNNI_PAIR_INTO(acc, w, KM, c, ZS)
/* As VNNI_PAIR_SCALED, into the accumulators A[m]. */
#define VNNI_PAIR_INTO(A, w, KM, c, ZS)                                                                            \
    for (int m = 0; m < MR; m++) {                                                                                 \
        const int8_t *p_ = qx + m * K + (c) * BLOCK;                                                               \
        const __m512i z_ = (ZS) >= 0 ? _mm512_loadu_si512(s4 + m * (K / 4) + (c) * 8) : _mm512_setzero_si512();   \
        __m512i d_;                                                                                                \
        if (PL == 1)                                                                                               \
            d_ = _mm512_dpbusd_epi32(_mm512_slli_epi32(z_, (ZS) < 0 ? 0 : (ZS)), w, _mm512_loadu_si512(p_));       \
        else if ((ZS) == 7 || (ZS) < 0)                                                                            \
            d_ = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(z_, w, _mm512_loadu_si512(p_)), 7), w,   \
                                     _mm512_loadu_si512(p_ + lo));                                                 \
        else                                                                                                       \
            d_ = _mm512_add_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), \
                                  w, _mm512_loadu_si512(p_)), 7), w, _mm512_loadu_si512(p_ + lo)),                  \
                                  _mm512_slli_epi32(z_, (ZS) < 0 ? 0 : (ZS)));                                      \
        (A)[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_), KM, (A)[m]);                                              \
    }

/* A second set of accumulators for one or two activation rows, whose pairs' multiply-adds were otherwise one chain
 * of 4-cycle latencies each (Zen 4, Q4_K at 15-bit, one thread from L3: 15.1 → 16.0 GB/s); more rows are chains
 * enough, and more accumulators would spill. */
#define VNNI_SECOND_ACC                                                                                            \
    __m512 acc2_[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};                                                  \
    __m512 *const acc_b = MR <= 2 ? acc2_ : acc;
#define VNNI_SECOND_ACC_END                                                                                        \
    if (MR <= 2)                                                                                                   \
        for (int m = 0; m < MR; m++) acc[m] = _mm512_add_ps(acc[m], acc2_[m]);

/* As VNNI_PAIR_SCALED, with ws the lanes' weight scales (each row's dx applied here). */
#define VNNI_PAIR(w, ws, c, ZS) VNNI_PAIR_SCALED(w, _mm512_mul_ps(ws, pair_lanes(dx + m * B + (c))), c, ZS)

/* The multipliers of a dot's sixteen lanes from per-block values v (one a block of 32, or a sub-block): lanes 0-7
 * v[a], 8-15 v[b] (a pair of blocks), or lanes 4i .. 4i + 3 v[a + i] (four blocks' halves side by side). */
VNNI static inline __m512 two_lanes(__m512 v, int a, int b) {
    return _mm512_permutexvar_ps(_mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(b), 1), v);
}
VNNI static inline __m512 four_lanes(__m512 v, int a) {
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                                  _mm512_set1_epi32(a)), v);
}

/* As VNNI_PAIR for one block (the last of an odd count), at 256 bits. */
#define VNNI_ONE(w, ws, c, ZS)                                                                                     \
    for (int m = 0; m < MR; m++) {                                                                                 \
        const int8_t *p_ = qx + m * K + (c) * BLOCK;                                                               \
        __m256i d_ = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, _mm256_loadu_si256((const __m256i *)p_));      \
        if (PL == 2) d_ = _mm256_dpbusd_epi32(_mm256_slli_epi32(d_, 7), w, _mm256_loadu_si256((const __m256i *)(p_ + lo))); \
        if ((ZS) >= 0) d_ = _mm256_add_epi32(d_, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(s4 + m * (K / 4) + (c) * 8)), (ZS) < 0 ? 0 : (ZS))); \
        tail[m] += dx[m * B + (c)] * (ws) * hsum(_mm256_cvtepi32_ps(d_));                                          \
    }

#define VNNI_ROW_BEGIN                                                                                             \
    const int64_t B = K / BLOCK;                                                                                   \
    __m512 acc[8];                                                                                                 \
    float tail[8] = {0};                                                                                           \
    for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
#define VNNI_ROW_END for (int m = 0; m < MR; m++) out[m] = _mm512_reduce_add_ps(acc[m]) + tail[m];

#define VNNI_ROW_ARGS                                                                                              \
    const uint8_t *row, const int8_t *qx, const float *dx, const float *xsum, const int32_t *s4, int64_t K,         \
        int64_t k0, int64_t k1, int64_t lo, int64_t ahead, float *out, const int MR, const int PL
#define VNNI_ROW(NAME) VNNI static inline __attribute__((always_inline)) void NAME(VNNI_ROW_ARGS)

/* 16 bytes (q0) and 16 more (q1), each two blocks' halves of nibbles (byte j: weight j low, j + 16 high)
 * → 64 codes: q0's 32 weights, then q1's. */
VNNI static inline __m512i nibble_pairs(__m128i q0, __m128i q1) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    const __m256i a = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q0, 4), q0), m);
    const __m256i b = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q1, 4), q1), m);
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}
VNNI static inline __m256i nibble_block(__m128i q) {
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}
/* A 16-entry codebook of unsigned codes (IQ4_U8, MXFP4_U8) in each 128-bit lane, for shuffle_epi8. */
VNNI static inline __m512i codebook(const uint8_t *book) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)book));
}

/* The float16 at b + at[i] for sixteen byte offsets (sixteen blocks' scales or mins), as float. */
VNNI static inline __m512 block_halves(const uint8_t *b, __m512i at) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(at, (const void *)b, 1)));
}

/* e8m0_at of the bytes at b + at[i] for sixteen byte offsets (sixteen MXFP4 blocks' exponents). */
VNNI static inline __m512 block_e8m0s(const uint8_t *b, __m512i at) {
    const __m512i e = _mm512_and_si512(_mm512_i32gather_epi32(at, (const void *)b, 1), _mm512_set1_epi32(0xFF));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, subnormal));
}

/* The 32-weight types: sixteen blocks at a time (their scales gathered at once), then two, then one. MIN: the
 * byte offset of a block's float16 min m (Q4_1 / Q5_1: w = d * q + m, m meeting xsum), 0 for none. SCALE1(b):
 * block b's scale (at its byte 0) as float; SCALE16(b, at): sixteen blocks' at once (b + at[i]): f16_at and
 * block_halves, or MXFP4's e8m0_at and block_e8m0s. The prefetch is T0: a non-temporal one, evicted before
 * its row's turn comes, left the stream at 7-12 GB/s. */
#define DEFINE_VNNI_ROW32(NAME, STRIDE, CODES2, CODES1, ZS, MIN, SCALE1, SCALE16)                                    \
    VNNI_ROW(NAME) {                                                                                               \
        VNNI_ROW_BEGIN                                                                                             \
        VNNI_SECOND_ACC                                                                                            \
        int64_t c = k0 / BLOCK;                                                                                    \
        const __m512i at_ = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), \
                                               _mm512_set1_epi32(STRIDE));                                         \
        for (; c + 16 <= k1 / BLOCK; c += 16) {                                                                    \
            const uint8_t *b16 = row + c * (STRIDE);                                                               \
            const __m512 ws16 = SCALE16(b16, at_);                                                                 \
            __m512 k16[8];                                                                                         \
            for (int m = 0; m < MR; m++) k16[m] = _mm512_mul_ps(ws16, _mm512_loadu_ps(dx + m * B + c));            \
            if (MIN) {                                                                                             \
                const __m512 mn16 = block_halves(b16 + (MIN), at_);                                                \
                for (int m = 0; m < MR; m++) acc[m] = _mm512_fmadd_ps(mn16, _mm512_loadu_ps(xsum + m * B + c), acc[m]); \
            }                                                                                                      \
            for (int j = 0; j < 8; j++) {                                                                          \
                const uint8_t *b = b16 + 2 * j * (STRIDE);                                                         \
                _mm_prefetch((const char *)b + ahead, _MM_HINT_T0);                                                \
                const __m512i w = CODES2(b);                                                                       \
                if (j & 1)                                                                                         \
                    VNNI_PAIR_INTO(acc_b, w, two_lanes(k16[m], 2 * j, 2 * j + 1), c + 2 * j, ZS)                   \
                else                                                                                               \
                    VNNI_PAIR_SCALED(w, two_lanes(k16[m], 2 * j, 2 * j + 1), c + 2 * j, ZS)                        \
            }                                                                                                      \
        }                                                                                                          \
        VNNI_SECOND_ACC_END                                                                                        \
        for (; c + 1 < k1 / BLOCK; c += 2) {                                                                       \
            const uint8_t *b = row + c * (STRIDE);                                                                 \
            _mm_prefetch((const char *)b + ahead, _MM_HINT_T0);                                                    \
            const __m512i w = CODES2(b);                                                                           \
            const __m512 ws = lane_halves(SCALE1(b), SCALE1(b + (STRIDE)));                                        \
            VNNI_PAIR(w, ws, c, ZS)                                                                                \
            if (MIN)                                                                                               \
                for (int m = 0; m < MR; m++)                                                                       \
                    tail[m] += f16_at(b + (MIN)) * xsum[m * B + c] + f16_at(b + (STRIDE) + (MIN)) * xsum[m * B + c + 1]; \
        }                                                                                                          \
        if (c < k1 / BLOCK) {                                                                                      \
            const uint8_t *b = row + c * (STRIDE);                                                                 \
            const __m256i w = CODES1(b);                                                                           \
            const float ws = SCALE1(b);                                                                            \
            VNNI_ONE(w, ws, c, ZS)                                                                                 \
            if (MIN)                                                                                               \
                for (int m = 0; m < MR; m++) tail[m] += f16_at(b + (MIN)) * xsum[m * B + c];                       \
        }                                                                                                          \
        VNNI_ROW_END                                                                                               \
    }
/* A pair of blocks' (S bytes each) nibbles at byte Q of each → 64 codes; one block's → 32. */
#define NIBBLES2(b, Q, S) \
    nibble_pairs(_mm_loadu_si128((const __m128i *)((b) + (Q))), _mm_loadu_si128((const __m128i *)((b) + (S) + (Q))))
#define NIBBLES1(b, Q) nibble_block(_mm_loadu_si128((const __m128i *)((b) + (Q))))
/* Those codes looked up in a codebook (IQ4_U8, MXFP4_U8). */
#define BOOK2(book, codes) _mm512_shuffle_epi8(codebook(book), codes)
#define BOOK1(book, codes) _mm256_shuffle_epi8(_mm512_castsi512_si256(codebook(book)), codes)
#define Q4_0_CODES2(b) NIBBLES2(b, 2, 18)
#define Q4_0_CODES1(b) NIBBLES1(b, 2)
#define IQ4_NL_CODES2(b) BOOK2(IQ4_U8, Q4_0_CODES2(b))
#define IQ4_NL_CODES1(b) BOOK1(IQ4_U8, Q4_0_CODES1(b))
#define MXFP4_CODES2(b) BOOK2(MXFP4_U8, NIBBLES2(b, 1, 17))
#define MXFP4_CODES1(b) BOOK1(MXFP4_U8, NIBBLES1(b, 1))
#define Q8_0_CODES2(b)                                                                                               \
    _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)((b) + 2))),       \
                                        _mm256_loadu_si256((const __m256i *)((b) + 36)), 1), _mm512_set1_epi8((char)0x80))
#define Q8_0_CODES1(b) _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)((b) + 2)), _mm256_set1_epi8((char)0x80))
/* Q5_0 / Q5_1: the nibbles plus 16 where the block's fifth-bit word (bit j: weight j), read as a lane mask, is set. */
VNNI static inline __m256i five_bit_block(const uint8_t *fifth, const uint8_t *qs) {
    uint32_t bits;
    memcpy(&bits, fifth, 4);
    const __m256i q = nibble_block(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_mask_add_epi8(q, (__mmask32)bits, q, _mm256_set1_epi8(16));
}
#define FIVE_CODES2(b, F, Q, S) _mm512_inserti64x4(_mm512_castsi256_si512(five_bit_block((b) + (F), (b) + (Q))), five_bit_block((b) + (S) + (F), (b) + (S) + (Q)), 1)
#define Q4_1_CODES2(b) NIBBLES2(b, 4, 20)
#define Q4_1_CODES1(b) NIBBLES1(b, 4)
#define Q5_0_CODES2(b) FIVE_CODES2(b, 2, 6, 22)
#define Q5_0_CODES1(b) five_bit_block((b) + 2, (b) + 6)
#define Q5_1_CODES2(b) FIVE_CODES2(b, 4, 8, 24)
#define Q5_1_CODES1(b) five_bit_block((b) + 4, (b) + 8)
DEFINE_VNNI_ROW32(ggml_row_vnni_q4_0, 18, Q4_0_CODES2, Q4_0_CODES1, 3, 0, f16_at, block_halves)
DEFINE_VNNI_ROW32(ggml_row_vnni_q4_1, 20, Q4_1_CODES2, Q4_1_CODES1, -1, 2, f16_at, block_halves)
DEFINE_VNNI_ROW32(ggml_row_vnni_q5_0, 22, Q5_0_CODES2, Q5_0_CODES1, 4, 0, f16_at, block_halves)
DEFINE_VNNI_ROW32(ggml_row_vnni_q5_1, 24, Q5_1_CODES2, Q5_1_CODES1, -1, 2, f16_at, block_halves)
DEFINE_VNNI_ROW32(ggml_row_vnni_iq4_nl, 18, IQ4_NL_CODES2, IQ4_NL_CODES1, 7, 0, f16_at, block_halves)
DEFINE_VNNI_ROW32(ggml_row_vnni_q8_0, 34, Q8_0_CODES2, Q8_0_CODES1, 7, 0, f16_at, block_halves)
DEFINE_VNNI_ROW32(ggml_row_vnni_mxfp4, 17, MXFP4_CODES2, MXFP4_CODES1, 7, 0, e8m0_at, block_e8m0s)

/* Q4_K / Q5_K super-block b's sub-blocks 2j and 2j + 1 as 64 unsigned codes (nibbles at b + qs, low ones
 * sub-block 2j; Q5_K's fifth bits: bit 2j / 2j + 1 of its 32 bytes at b + 16). */
VNNI static inline __m512i k_quant_codes(const uint8_t *b, int qs, int fifth, int j) {
    const __m256i low = _mm256_set1_epi8(0x0F), q = _mm256_loadu_si256((const __m256i *)(b + qs + 32 * j));
    __m256i lo4 = _mm256_and_si256(q, low), hi4 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
    if (fifth) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), sixteen = _mm256_set1_epi8(16);
        lo4 = _mm256_mask_add_epi8(lo4, _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * j)))), lo4, sixteen);
        hi4 = _mm256_mask_add_epi8(hi4, _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(2 << (2 * j)))), hi4, sixteen);
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo4), hi4, 1);
}

/* Q6_K super-block b's half h: blocks 4h .. 4h + 3 of 32 as two vectors of 64 unsigned codes (0..63). */
VNNI static inline void q6_k_codes(const uint8_t *b, int h, __m512i *w0, __m512i *w1) {
    const __m512i low = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi8(0x30);
    const __m512i ab = _mm512_loadu_si512(b + 64 * h);
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
    /* (a & low) | c, one ternary-logic op: bits 4-5 of c are the high pair */
    *w0 = _mm512_ternarylogic_epi32(ab, low, _mm512_and_si512(_mm512_slli_epi16(hh, 4), pair), 0xEA);
    *w1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ab, 4), low, _mm512_and_si512(hh, pair), 0xEA);
}

/* 64 bytes at p → their 64 low nibbles (lo) and 64 high ones (hi), each a byte 0..15 in the bytes' order. */
VNNI static inline void nibble_halves(const uint8_t *p, __m512i *lo, __m512i *hi) {
    const __m512i low = _mm512_set1_epi8(0x0F), q = _mm512_loadu_si512(p);
    *lo = _mm512_and_si512(q, low), *hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
}

/* Q4_K / Q5_K super-block b's half h (64 bytes of nibbles at b + qs + 64h) as two vectors of 64 unsigned codes: w0
 * the low nibbles, sub-blocks 4h and 4h + 2; w1 the high ones, 4h + 1 and 4h + 3 (Q5_K's fifth bits: bit 4h + i of
 * its 32 bytes at b + 16 for sub-block 4h + i). The activation codes they meet are in that order (ggml_vnni_order). */
VNNI static inline void k_quant_halves(const uint8_t *b, int qs, int fifth, int h, __m512i *w0, __m512i *w1) {
    nibble_halves(b + qs + 64 * h, w0, w1);
    if (fifth) {
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16))), sixteen = _mm512_set1_epi8(16);
        const __m512i bit0 = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << 4 * h)), _mm256_set1_epi8((char)(4 << 4 * h)), 1);
        *w0 = _mm512_mask_add_epi8(*w0, _mm512_test_epi8_mask(qh, bit0), *w0, sixteen);
        *w1 = _mm512_mask_add_epi8(*w1, _mm512_test_epi8_mask(qh, _mm512_add_epi8(bit0, bit0)), *w1, sixteen);
    }
}

/* Q4_K / Q5_K: each half super-block's codes 64 bytes at a time (k_quant_halves), against activation codes whose
 * blocks are in that order (ggml_vnni_order: blocks 4h + 2 and 4h + 1 trade places), mins against xsum. The eight
 * scales and eight mins go through one 512-bit vector, sc: lanes 0-7 d * scale, 8-15 dmin * min; against one of dx
 * (lanes 0-7) and xsum (8-15), its low half makes the pairs' multipliers and its high half adds the mins' terms. */
#define DEFINE_VNNI_ROW_K(NAME, S, QS, FIFTH)                                                                        \
    VNNI_ROW(NAME) {                                                                                               \
        (void)s4;                                                                                                  \
        VNNI_ROW_BEGIN                                                                                             \
        __m512 macc[8];                                                                                            \
        for (int m = 0; m < MR; m++) macc[m] = _mm512_setzero_ps();                                                \
        VNNI_SECOND_ACC                                                                                            \
        const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);                 \
        for (int64_t sb = k0 / QK_K; sb < k1 / QK_K; sb++) {                                                       \
            const uint8_t *b = row + sb * (S);                                                                     \
            PREFETCH_SUPER(b, S);                                                                                  \
            int dd_;                                                                                               \
            memcpy(&dd_, b, 4);                                                                                    \
            const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(dd_)); /* d, dmin */                                  \
            const __m512 sc = _mm512_mul_ps(_mm512_permutexvar_ps(halves, _mm512_castps128_ps512(d2)),               \
                                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k_scale_bytes(b + 4))));       \
            __m512 k[8];                                                                                           \
            for (int m = 0; m < MR; m++) {                                                                         \
                const __m512 x_ = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(dx + m * B + sb * 8)), \
                                                     _mm256_loadu_ps(xsum + m * B + sb * 8), 1);                   \
                k[m] = _mm512_mul_ps(sc, x_);                                                                      \
                macc[m] = _mm512_mask3_fmadd_ps(sc, x_, macc[m], 0xFF00);                                          \
            }                                                                                                      \
            for (int h = 0; h < 2; h++) {                                                                          \
                __m512i w0, w1;                                                                                    \
                k_quant_halves(b, QS, FIFTH, h, &w0, &w1);                                                         \
                VNNI_PAIR_SCALED(w0, two_lanes(k[m], 4 * h, 4 * h + 2), sb * 8 + 4 * h, -1)                        \
                VNNI_PAIR_INTO(acc_b, w1, two_lanes(k[m], 4 * h + 1, 4 * h + 3), sb * 8 + 4 * h + 2, -1)          \
            }                                                                                                      \
        }                                                                                                          \
        VNNI_SECOND_ACC_END                                                                                        \
        for (int m = 0; m < MR; m++) tail[m] = -hsum(_mm512_extractf32x8_ps(macc[m], 1));                         \
        VNNI_ROW_END                                                                                               \
    }
DEFINE_VNNI_ROW_K(ggml_row_vnni_q4_k, 144, 16, 0)
DEFINE_VNNI_ROW_K(ggml_row_vnni_q5_k, 176, 48, 1)

/* Q6_K: per 128-weight half h, 64 bytes of low nibbles (A, B), 32 of high pairs (H): blocks 4h .. 4h + 3 are
 * A & 15 | H0 << 4, B & 15 | H1 << 4, A >> 4 | H2 << 4, B >> 4 | H3 << 4 (Hk: bits 2k, 2k + 1 of H);
 * sixteen int8 scales, one per 16 weights. */
VNNI_ROW(ggml_row_vnni_q6_k) {
    VNNI_ROW_BEGIN
    const int64_t G = K / 16;
    __m512 zero_terms[8]; /* the zero point's: per 16 weights, its scale x the activations' sum (xsum16) */
    for (int m = 0; m < MR; m++) zero_terms[m] = _mm512_setzero_ps();
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    VNNI_SECOND_ACC
    for (int64_t sb = k0 / QK_K; sb < k1 / QK_K; sb++) {
        const uint8_t *b = row + sb * 210;
        PREFETCH_SUPER(b, 210);
        const __m512 s16 = _mm512_mul_ps(_mm512_set1_ps(f16_at(b + 208)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
        __m512 k[8]; /* each sub-block's scale x its block's dx */
        for (int m = 0; m < MR; m++)
            k[m] = _mm512_mul_ps(s16, _mm512_permutexvar_ps(_mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 1),
                                                            _mm512_castps256_ps512(_mm256_loadu_ps(dx + m * B + sb * 8))));
        for (int h = 0; h < 2; h++) {
            __m512i w0, w1;
            q6_k_codes(b, h, &w0, &w1);
            const int64_t c = sb * 8 + 4 * h;
            const __m512i at0 = _mm512_add_epi32(spread, _mm512_set1_epi32(8 * h)), at1 = _mm512_add_epi32(at0, _mm512_set1_epi32(4));
            VNNI_PAIR_SCALED(w0, _mm512_permutexvar_ps(at0, k[m]), c, -1)
            VNNI_PAIR_INTO(acc_b, w1, _mm512_permutexvar_ps(at1, k[m]), c + 2, -1)
        }
        for (int m = 0; m < MR; m++) zero_terms[m] = _mm512_fmadd_ps(s16, _mm512_loadu_ps(xsum + m * G + sb * 16), zero_terms[m]);
    }
    VNNI_SECOND_ACC_END
    for (int m = 0; m < MR; m++) tail[m] = -32.0f * _mm512_reduce_add_ps(zero_terms[m]);
    VNNI_ROW_END
}

/* IQ4_XS super-block b's sub-blocks 2j and 2j + 1 as 64 unsigned codebook codes (IQ4_U8). */
VNNI static inline __m512i iq4_xs_codes(const uint8_t *b, int j) {
    return BOOK2(IQ4_U8, NIBBLES2(b + 8 + 32 * j, 0, 16));
}

/* IQ4_XS: eight sub-blocks of 32 (16 bytes of nibbles each, as IQ4_NL's), codebook values, 6-bit scales. */
VNNI_ROW(ggml_row_vnni_iq4_xs) {
    (void)xsum;
    VNNI_ROW_BEGIN
    const __m512i book = codebook(IQ4_U8);
    VNNI_SECOND_ACC
    for (int64_t sb = k0 / QK_K; sb < k1 / QK_K; sb++) {
        const uint8_t *b = row + sb * 136;
        PREFETCH_SUPER(b, 136);
        uint32_t low;
        uint16_t high;
        memcpy(&low, b + 4, 4), memcpy(&high, b + 2, 2);
        const __m256i i8 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i ls = _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)low), _mm256_slli_epi32(i8, 2)), _mm256_set1_epi32(15)),
                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(high), _mm256_slli_epi32(i8, 1)), _mm256_set1_epi32(3)), 4));
        const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(f16_at(b)), _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
        __m512 k[8];
        for (int m = 0; m < MR; m++) k[m] = _mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_loadu_ps(dx + m * B + sb * 8)));
        for (int h = 0; h < 2; h++) { /* 128-bit lane i: sub-block 4h + i's first 16 weights (w0), its last 16 (w1) */
            __m512i w0, w1;
            nibble_halves(b + 8 + 64 * h, &w0, &w1);
            w0 = _mm512_shuffle_epi8(book, w0), w1 = _mm512_shuffle_epi8(book, w1);
            VNNI_PAIR_SCALED(w0, four_lanes(k[m], 4 * h), sb * 8 + 4 * h, 7)
            VNNI_PAIR_INTO(acc_b, w1, four_lanes(k[m], 4 * h), sb * 8 + 4 * h + 2, 7)
        }
    }
    VNNI_SECOND_ACC_END
    VNNI_ROW_END
}

/* ---- a run of rows ------------------------------------------------------------------------------ */

/* The activation rows as the row functions take them (quantize_rows' qx, dx, xsum with groups of 32; s4; xsum16,
 * made by ggml_segment_rows where a segment's rows read it). */
typedef struct {
    const int8_t *qx;
    const float *dx, *xsum;
    const int32_t *s4;
    int64_t K;
    int planes;
    const float *xsum16;
    const float *x; /* the float activations [M, K] (ggml_half's types) */
} GGMLActs;

/* xsum16 [M, K / 16]: dx times the sum of the codes of each 16 activations (llama.cpp's Q8_K bsums), which
 * Q2_K's mins and Q3_K's zero points, one per 16 weights, meet. */
static void activation_sums16(const GGMLActs *a, int64_t M, float *xsum16) {
    const int64_t K = a->K;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / 16; g++) {
            const int8_t *h = a->qx + m * K + 16 * g;
            int32_t s = 0;
            for (int i = 0; i < 16; i++) s += a->planes == 2 ? 128 * h[i] + h[M * K + i] : h[i];
            xsum16[m * (K / 16) + g] = a->dx[m * (K / BLOCK) + g / 2] * (float)s;
        }
}

/* a with its xsum16 made where it has none: the memory made (for the caller to free), or NULL. */
static float *with_sums16(GGMLActs *a, int64_t M) {
    if (a->xsum16) return NULL;
    float *sums16 = malloc(sizeof(float) * M * (a->K / 16));
    activation_sums16(a, M, sums16);
    a->xsum16 = sums16;
    return sums16;
}

#define GGML_TILE_ROWS 16
#define GGML_AHEAD (16 << 10) /* bytes a whole-row walk prefetches ahead */

/* Whether the VNNI rows walk whole rows (as the AVX2 rows do) rather than GGML_CHUNK at a time: on AMD's cores.
 * Zen 4, batch 1, Q4_K ffn_up 8,192 x 2,048 from memory at 2 threads: sixteen interleaved streams read 13.1 GB/s,
 * one whole-row stream 19.7 (Q6_K ffn_down: 14.6 / 17.6); on Sapphire Rapids one stream read 4 GB/s. */
static inline int ggml_vnni_whole_rows(void) {
    static int cached = -1;
    if (cached < 0) cached = __builtin_cpu_is("amd");
    return cached;
}

/* Weight rows [n0, n1) (row n at blocks + n * its bytes) against M activation rows, into y[m * ld + n - n0]:
 * tiles of GGML_TILE_ROWS rows, walked `chunk` weights of each row at a time, while every eight activation rows
 * pass over each chunk in cache (a prefill chunk streams the weight once, as a decode step). VNNI takes
 * GGML_CHUNK on Intel: sixteen streams from memory at once (one alone waits on its loads on Sapphire Rapids:
 * 4 GB/s where sixteen reach the bandwidth). AVX2, and VNNI on AMD (ggml_vnni_whole_rows), take whole rows, one
 * stream prefetched GGML_AHEAD bytes on: on Zen 2 sixteen interleaved streams of 1,024 weights read 10.5 GB/s of
 * Q4_K where one whole-row stream reads 15-18. */
#define GGML_TILED(CALL, FN)                                                                              \
    for (int64_t t0 = n0; t0 < n1; t0 += GGML_TILE_ROWS)                                                \
        for (int64_t m0 = 0; m0 < M; m0 += 8) {                                                         \
            const int64_t mr = M - m0 < 8 ? M - m0 : 8, t1 = t0 + GGML_TILE_ROWS < n1 ? t0 + GGML_TILE_ROWS : n1; \
            const int8_t *q = a->qx + m0 * K;                                                           \
            const float *d = a->dx + m0 * (K / BLOCK);                                                  \
            const float *xs = ggml_sums16(type) ? a->xsum16 + m0 * (K / 16) : a->xsum + m0 * (K / BLOCK); \
            const int32_t *s4m = a->s4 + m0 * (K / 4);                                                  \
            (void)s4m;                                                                                  \
            float sums[GGML_TILE_ROWS][8] = {{0}};                                                      \
            for (int64_t k0 = 0; k0 < K; k0 += chunk) {                                                 \
                const int64_t k1 = k0 + chunk < K ? k0 + chunk : K;                                     \
                /* prefetch what comes a tile's rows later: this row's next chunk, or after the last  \
                   chunk the next tile's first (a fixed distance ahead; 16 KB on read 7-14 GB/s) */     \
                const int64_t ahead = whole ? GGML_AHEAD                                                \
                                    : k1 < K ? ggml_row_bytes(type, k1 - k0)                            \
                                             : GGML_TILE_ROWS * row_bytes - ggml_row_bytes(type, k0);   \
                for (int64_t n = t0; n < t1; n++) {                                                     \
                    const uint8_t *w = blocks + n * row_bytes;                                          \
                    float out[8];                                                                       \
                    FOR_ROWS_OF(mr, CALL, FN);                                                          \
                    for (int64_t m = 0; m < mr; m++) sums[n - t0][m] += out[m];                         \
                }                                                                                       \
            }                                                                                           \
            for (int64_t n = t0; n < t1; n++)                                                           \
                for (int64_t m = 0; m < mr; m++) y[(m0 + m) * ld + n - n0] = sums[n - t0][m];           \
        }
/* CALL(FN, MR) for the row count M (1..8) as a literal (FOR_ROWS's, with the row function named). */
#define FOR_ROWS_OF(M, CALL, FN)                                                                        \
    switch (M) {                                                                                        \
    case 1: CALL(FN, 1); break; case 2: CALL(FN, 2); break;                                             \
    case 3: CALL(FN, 3); break; case 4: CALL(FN, 4); break;                                             \
    case 5: CALL(FN, 5); break; case 6: CALL(FN, 6); break;                                             \
    case 7: CALL(FN, 7); break; default: CALL(FN, 8); break;                                            \
    }
#define GGML_AVX2_CALL(FN, MR) FN(w, q, d, xs, K, k0, k1, lo, ahead, out, MR, PL)
#define GGML_VNNI_CALL(FN, MR) FN(w, q, d, xs, s4m, K, k0, k1, lo, ahead, out, MR, PL)
#define GGML_CASE(CALL, TYPE, NAME) \
    case GGML_##TYPE: WITH_PLANES(a->planes, GGML_TILED(CALL, ggml_row_##NAME)); break;
/* The slice function of one ISA: a case per type (MORE: cases of its own). */
#define DEFINE_GGML_SLICE(ATTR, CALL, NAME, isa, WHOLE, MORE)                                             \
    ATTR static void NAME(int64_t type, const uint8_t *blocks, int64_t n0, int64_t n1,                    \
                          const GGMLActs *a, int64_t M, float *y, int64_t ld) {                           \
        const int64_t K = a->K, row_bytes = ggml_row_bytes(type, K), lo = M * K, whole = WHOLE;           \
        const int64_t chunk = whole ? K : GGML_CHUNK;                                                     \
        switch (type) {                                                                                   \
            GGML_CASE(CALL, Q4_0, isa##_q4_0)                                                              \
            GGML_CASE(CALL, Q8_0, isa##_q8_0)                                                              \
            GGML_CASE(CALL, Q4_1, isa##_q4_1)                                                              \
            GGML_CASE(CALL, Q5_0, isa##_q5_0)                                                              \
            GGML_CASE(CALL, Q5_1, isa##_q5_1)                                                              \
            GGML_CASE(CALL, IQ4_NL, isa##_iq4_nl)                                                          \
            GGML_CASE(CALL, Q4_K, isa##_q4_k)                                                              \
            GGML_CASE(CALL, Q5_K, isa##_q5_k)                                                              \
            GGML_CASE(CALL, Q6_K, isa##_q6_k)                                                              \
            GGML_CASE(CALL, IQ4_XS, isa##_iq4_xs)                                                          \
            GGML_CASE(CALL, MXFP4, isa##_mxfp4)                                                            \
            MORE                                                                                          \
        }                                                                                                 \
    }
DEFINE_GGML_SLICE(, GGML_AVX2_CALL, ggml_slice_avx2, avx2, 1, GGML_CASE(GGML_AVX2_CALL, Q2_K, avx2_q2_k) GGML_CASE(GGML_AVX2_CALL, Q3_K, avx2_q3_k))
DEFINE_GGML_SLICE(VNNI, GGML_VNNI_CALL, ggml_vnni_rows, vnni, ggml_vnni_whole_rows(), )

/* The order, per 256 activations, of the activation codes' granules that the VNNI rows of a type meet where its
 * 64-byte code loads hold its weights out of order (else 0). Q4_K / Q5_K (granules of 32): the low nibbles of 64 bytes
 * are sub-blocks 4h and 4h + 2, the high ones 4h + 1 and 4h + 3. IQ4_XS (granules of 16, s4 too): the low nibbles are
 * the first 16 weights of sub-blocks 4h .. 4h + 3, the high ones their last 16. Trading the activations' granules once
 * per call costs less than shuffling the weights' in every row (Zen 4, rows from L2, one thread, GB/s, 32-byte loads
 * / 64-byte: Q4_K 15.3-16.6 / 17.5-18.1 at 15-bit, 16.6-18.7 / 20.0-20.4 at int8). */
static inline int ggml_vnni_order(int64_t type, const int **order) {
    static const int K_ORDER[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    static const int IQ4_XS_ORDER[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};
    if (type == GGML_Q4_K || type == GGML_Q5_K) return *order = K_ORDER, 32;
    if (type == GGML_IQ4_XS) return *order = IQ4_XS_ORDER, 16;
    return 0;
}
/* rows of `bytes` each, granules of `granule` bytes put in `order` per 256 bytes */
static void ggml_reorder(const void *from, int64_t rows, int64_t bytes, int granule, const int *order, void *to) {
    const int64_t run = 256 / granule;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < bytes / granule; i++)
            memcpy((char *)to + r * bytes + i * granule,
                   (const char *)from + r * bytes + (i - i % run + order[i % run]) * granule, granule);
}
#define ORDER_KEPT_MAX (1 << 20) /* bytes of a thread's reordered activations kept for its next call; more: per call */

VNNI static void ggml_slice_vnni(int64_t type, const uint8_t *blocks, int64_t n0, int64_t n1, const GGMLActs *a,
                                 int64_t M, float *y, int64_t ld) {
    const int *order;
    const int granule = ggml_vnni_order(type, &order);
    if (!granule) {
        ggml_vnni_rows(type, blocks, n0, n1, a, M, y, ld);
        return;
    }
    /* the planes' rows one after another, then (IQ4_XS's zero point) s4's: an int32 per 4 activations, K bytes a row */
    const int64_t K = a->K, rows = a->planes * M, sums = type == GGML_IQ4_XS, bytes = (rows + sums * M) * K;
    int8_t *codes = bytes > ORDER_KEPT_MAX ? aligned_alloc(64, bytes) : thread_kept(KEPT_ORDERED, bytes);
    GGMLActs ordered = *a;
    ggml_reorder(a->qx, rows, K, granule, order, codes);
    ordered.qx = codes;
    if (sums) {
        ggml_reorder(a->s4, M, K, granule, order, codes + rows * K);
        ordered.s4 = (const int32_t *)(codes + rows * K);
    }
    ggml_vnni_rows(type, blocks, n0, n1, &ordered, M, y, ld);
    if (bytes > ORDER_KEPT_MAX) free(codes);
}

/* ---- AVX2 batches: eight weight rows interleaved, no horizontal adds --------------------------------- */

/* A batch of activation rows (a prefill chunk) makes the AVX2 rows compute-bound, and their horizontal adds, one
 * reduction per block and activation row, the largest cost. So for a batch, eight weight rows at a time are unpacked once (ggml_unpack) into a panel where each step of four
 * weights holds the eight rows' codes side by side: one maddubs against four activation codes broadcast gives
 * the eight rows' products in their own lanes, summed down the block's eight steps in int16 (or int32: WIDEN, where
 * sixteen products may overflow int16) and scaled once a block (Q6_K: once per sixteen weights) — llama.cpp's
 * repacked GEMM, made per call from the file's own blocks and reused by every activation row. Packing costs about
 * what eight rows' dots do, so panels pay from 16 rows (Zen 2, 12288 x 4096: Q4_K 1.0x the row kernels at 8 rows,
 * 1.3x at 16, 1.5x at 32; Q6_K 1.05x, 1.2x, 1.5x) and for the types that sum in int32, slower per row, from 32
 * (Q8_0 0.7x at 8, 0.9x at 16, 1.1x at 32). */
#define GGML_PANEL_ROWS 8
static inline int ggml_panel_widens(int64_t t) {
    return t == GGML_Q8_0 || t == GGML_IQ4_NL || t == GGML_IQ4_XS || t == GGML_Q5_1 || t == GGML_Q5_K;
}
static inline int ggml_panels_pay(int64_t t, int64_t M) { return M >= (ggml_panel_widens(t) ? 32 : 16); }

/* v[j] lane i <- v[i] lane j: eight rows of eight 32-bit elements transposed. */
static inline void transpose8_epi32(__m256i *v) {
    __m256i t[8], u[8];
    for (int k = 0; k < 4; k++)
        t[2 * k] = _mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]), t[2 * k + 1] = _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
    for (int k = 0; k < 2; k++) /* rows 4k .. 4k + 3: elements 0, 1, 2, 3 (and 4 .. 7 in the high lane) */
        for (int j = 0; j < 2; j++) {
            u[4 * k + 2 * j] = _mm256_unpacklo_epi64(t[4 * k + j], t[4 * k + 2 + j]);
            u[4 * k + 2 * j + 1] = _mm256_unpackhi_epi64(t[4 * k + j], t[4 * k + 2 + j]);
        }
    for (int j = 0; j < 4; j++)
        v[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20), v[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
}

/* Rows a panel pack prefetches ahead of the ones it packs: the next group of panels that a batch's passes meet
 * together (ggml_panels_vnni), so that the file's bytes arrive while this group's dot products run. */
#define PANEL_PACK_AHEAD 32

/* transpose8_epi32 of eight rows of floats. */
static inline void transpose8_ps(__m256 *v) { transpose8_epi32((__m256i *)v); }

/* ggml_panel_pack for Q4_K / Q5_K, straight from the file's bytes: each 32-byte run of nibbles (a sub-block's low
 * nibbles and the next one's high) of the eight rows is transposed by dwords once, which puts both sub-blocks'
 * steps in place; Q5_K's fifth bits, transposed the same way, sit at the same byte positions. No row's codes go
 * through memory in between (ggml_unpack's way: a transpose per sub-block, from a buffer). */
static void k_panel_pack(int64_t t, const uint8_t *rows, int64_t row_bytes, int64_t K, int8_t *codes, float *s16,
                         float *mins) {
    const int q5 = t == GGML_Q5_K;
    const int64_t S = ggml_block_bytes(t);
    const int64_t ahead = PANEL_PACK_AHEAD * row_bytes; /* PREFETCH_SUPER's distance */
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t blk = 0; blk < K / QK_K; blk++) {
        __m256 sc[GGML_PANEL_ROWS], mn[GGML_PANEL_ROWS]; /* row r's eight sub-blocks, then (transposed) sub-block i's rows */
        __m256i fifth[GGML_PANEL_ROWS];
        for (int r = 0; r < GGML_PANEL_ROWS; r++) {
            const uint8_t *b = rows + r * row_bytes + blk * S;
            PREFETCH_SUPER(b, S);
            K_SCALES
            sc[r] = sc8, mn[r] = mn8;
            if (q5) fifth[r] = _mm256_loadu_si256((const __m256i *)(b + 16));
        }
        transpose8_ps(sc), transpose8_ps(mn);
        if (q5) transpose8_epi32(fifth);
        for (int j = 0; j < 4; j++) {
            __m256i v[GGML_PANEL_ROWS];
            for (int r = 0; r < GGML_PANEL_ROWS; r++)
                v[r] = _mm256_loadu_si256((const __m256i *)(rows + r * row_bytes + blk * S + (q5 ? 48 : 16) + 32 * j));
            transpose8_epi32(v);
            int8_t *c0 = codes + (blk * 8 + 2 * j) * 256, *c1 = c0 + 256;
            for (int step = 0; step < 8; step++) {
                __m256i u0 = _mm256_and_si256(v[step], low), u1 = _mm256_and_si256(_mm256_srli_epi16(v[step], 4), low);
                if (q5)
                    u0 = _mm256_or_si256(u0, q5_k_fifth(fifth[step], 2 * j)),
                    u1 = _mm256_or_si256(u1, q5_k_fifth(fifth[step], 2 * j + 1));
                _mm256_storeu_si256((__m256i *)(c0 + step * 32), u0), _mm256_storeu_si256((__m256i *)(c1 + step * 32), u1);
            }
        }
        for (int i = 0; i < 8; i++) { /* sc[r][i] → s16 (twice) and mn[r][i] → mins, sub-block i's eight rows in one */
            const int64_t b = blk * 8 + i;
            _mm256_storeu_ps(s16 + (2 * b) * 8, sc[i]), _mm256_storeu_ps(s16 + (2 * b + 1) * 8, sc[i]);
            _mm256_storeu_ps(mins + b * 8, mn[i]);
        }
    }
}

/* ggml_panel_pack for Q6_K, as k_panel_pack: a half's two runs of low bits and its run of high bits, each transposed
 * once for the eight rows, give its four sub-blocks' steps (q6_k_quarters_of at the same byte positions). No mins:
 * a signed type's panels never read them. */
static void q6_k_panel_pack(const uint8_t *rows, int64_t row_bytes, int64_t K, int8_t *codes, float *s16) {
    const int64_t S = ggml_block_bytes(GGML_Q6_K), ahead = PANEL_PACK_AHEAD * row_bytes; /* PREFETCH_SUPER's */
    for (int64_t blk = 0; blk < K / QK_K; blk++) {
        for (int h = 0; h < 2; h++) {
            __m256i a[GGML_PANEL_ROWS], c[GGML_PANEL_ROWS], hi[GGML_PANEL_ROWS];
            for (int r = 0; r < GGML_PANEL_ROWS; r++) {
                const uint8_t *b = rows + r * row_bytes + blk * S;
                a[r] = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
                c[r] = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
                hi[r] = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            }
            transpose8_epi32(a), transpose8_epi32(c), transpose8_epi32(hi);
            for (int step = 0; step < 8; step++) {
                __m256i u[4];
                q6_k_quarters_of(a[step], c[step], hi[step], u);
                for (int p = 0; p < 4; p++)
                    _mm256_storeu_si256((__m256i *)(codes + (blk * 8 + 4 * h + p) * 256 + step * 32),
                                        _mm256_sub_epi8(u[p], _mm256_set1_epi8(32)));
            }
        }
        __m256 s[2][GGML_PANEL_ROWS]; /* row r's scales 0-7 and 8-15 (d x its sixteen bytes), then transposed */
        for (int r = 0; r < GGML_PANEL_ROWS; r++) {
            const uint8_t *b = rows + r * row_bytes + blk * S;
            PREFETCH_SUPER(b, S);
            const __m256 d = _mm256_set1_ps(f16_at(b + 208));
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + 192));
            s[0][r] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
            s[1][r] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))));
        }
        transpose8_ps(s[0]), transpose8_ps(s[1]);
        for (int k = 0; k < 16; k++) _mm256_storeu_ps(s16 + (blk * 16 + k) * 8, s[k / 8][k % 8]);
    }
}

/* Panel for weight rows [n, n + 8) of K weights: codes [K / 32][8 steps][8 rows][4], scales s16 [K / 16][8 rows]
 * (ggml_unpack's, one per sixteen weights), mins [K / 32][8 rows] (Q2_K: [K / 16][8 rows]; read for the min types
 * alone). */
static void ggml_panel_pack(int64_t t, const uint8_t *rows, int64_t row_bytes, int64_t K, int8_t *codes, float *s16,
                            float *mins) {
    if (t == GGML_Q4_K || t == GGML_Q5_K) {
        k_panel_pack(t, rows, row_bytes, K, codes, s16, mins);
        return;
    }
    if (t == GGML_Q6_K) {
        q6_k_panel_pack(rows, row_bytes, K, codes, s16);
        return;
    }
    const int64_t W = ggml_block_weights(t), S = ggml_block_bytes(t);
    int8_t c[GGML_PANEL_ROWS][QK_K];
    float s[GGML_PANEL_ROWS][16], m[GGML_PANEL_ROWS][16];
    for (int64_t blk = 0; blk < K / W; blk++) {
        for (int r = 0; r < GGML_PANEL_ROWS; r++) ggml_unpack(t, rows + r * row_bytes + blk * S, c[r], s[r], m[r]);
        for (int64_t i = 0; i < W / BLOCK; i++) {
            const int64_t b = blk * (W / BLOCK) + i;
            __m256i v[GGML_PANEL_ROWS]; /* row r's block: eight steps of four codes; then step j's eight rows */
            for (int r = 0; r < GGML_PANEL_ROWS; r++) v[r] = _mm256_loadu_si256((const __m256i *)(c[r] + i * BLOCK));
            transpose8_epi32(v);
            for (int step = 0; step < 8; step++) _mm256_storeu_si256((__m256i *)(codes + b * 256 + step * 32), v[step]);
            for (int r = 0; r < GGML_PANEL_ROWS; r++) {
                s16[(2 * b) * 8 + r] = s[r][2 * i], s16[(2 * b + 1) * 8 + r] = s[r][2 * i + 1];
                if (t == GGML_Q2_K)
                    mins[(2 * b) * 8 + r] = m[r][2 * i], mins[(2 * b + 1) * 8 + r] = m[r][2 * i + 1];
                else
                    mins[b * 8 + r] = m[r][i];
            }
        }
    }
}

/* acc[m] (lane r: weight row r) += the panel's dots with activation rows m < MR. SIGNED: signed codes (the sign
 * trick); MIN: mins against xsum (2: one per sixteen weights, against xsum16: Q2_K); HALF: a scale per sixteen
 * weights (Q2_K, Q3_K, Q6_K); WIDEN: products summed in int32. */
static inline __attribute__((always_inline)) void ggml_panel_dot(const int8_t *codes, const float *s16,
                                                                 const float *mins, const int8_t *qx, const float *dx,
                                                                 const float *xsum, int64_t K, int64_t lo, __m256 *acc,
                                                                 const int MR, const int PL, const int SIGNED,
                                                                 const int MIN, const int HALF, const int WIDEN) {
    const int64_t B = K / BLOCK;
    for (int64_t b = 0; b < B; b++) {
        for (int h = 0; h < (HALF ? 2 : 1); h++) {
            __m256i hi[4], low[4];
            for (int m = 0; m < MR; m++) hi[m] = low[m] = _mm256_setzero_si256();
            for (int step = HALF ? 4 * h : 0; step < (HALF ? 4 * h + 4 : 8); step++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(codes + b * 256 + step * 32));
                const __m256i u = SIGNED ? _mm256_sign_epi8(w, w) : w;
                for (int m = 0; m < MR; m++) {
                    int32_t x4;
                    memcpy(&x4, qx + m * K + b * BLOCK + 4 * step, 4);
                    const __m256i x = _mm256_set1_epi32(x4);
                    const __m256i p = _mm256_maddubs_epi16(u, SIGNED ? _mm256_sign_epi8(x, w) : x);
                    hi[m] = WIDEN ? _mm256_add_epi32(hi[m], _mm256_madd_epi16(p, ONES16)) : _mm256_add_epi16(hi[m], p);
                    if (PL == 2) { /* the low plane's codes are unsigned: no sign trick */
                        memcpy(&x4, qx + lo + m * K + b * BLOCK + 4 * step, 4);
                        const __m256i xl = _mm256_set1_epi32(x4);
                        const __m256i pl = SIGNED ? _mm256_maddubs_epi16(xl, w) : _mm256_maddubs_epi16(u, xl);
                        low[m] = WIDEN ? _mm256_add_epi32(low[m], _mm256_madd_epi16(pl, ONES16)) : _mm256_add_epi16(low[m], pl);
                    }
                }
            }
            const __m256 ws = _mm256_loadu_ps(s16 + (2 * b + h) * 8);
            for (int m = 0; m < MR; m++) {
                __m256i d = WIDEN ? hi[m] : _mm256_madd_epi16(hi[m], PL == 1 ? ONES16 : HIGH16);
                if (PL == 2) d = WIDEN ? _mm256_add_epi32(_mm256_slli_epi32(d, 7), low[m])
                                       : _mm256_add_epi32(d, _mm256_madd_epi16(low[m], ONES16));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(ws, _mm256_set1_ps(dx[m * B + b])), acc[m]);
            }
            if (MIN == 2) {
                const __m256 mn = _mm256_loadu_ps(mins + (2 * b + h) * 8);
                for (int m = 0; m < MR; m++) acc[m] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(xsum[m * (K / 16) + 2 * b + h]), acc[m]);
            }
        }
        if (MIN == 1) {
            const __m256 mn = _mm256_loadu_ps(mins + b * 8);
            for (int m = 0; m < MR; m++) acc[m] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(xsum[m * B + b]), acc[m]);
        }
    }
}

#define GGML_PANEL_CALL(MR)                                                                                          \
    do {                                                                                                           \
        __m256 acc[4];                                                                                             \
        for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();                                                 \
        ggml_panel_dot(codes, s16, mins, a->qx + m0 * K, a->dx + m0 * B, xs + m0 * XG, K, lo, acc, MR, PL,          \
                       SIGNED, MIN, HALF, WIDEN);                                                                  \
        for (int m = 0; m < MR; m++) _mm256_storeu_ps(y + (m0 + m) * ld + n - n0, acc[m]);                         \
    } while (0)

/* Weight rows [n0, n1) against M activation rows (ggml_panels_pay), as ggml_slice: eight rows a panel, four
 * activation rows a pass over it; the last rows short of eight by the row kernels. */
static void ggml_panels_avx2(int64_t type, const uint8_t *blocks, int64_t n0, int64_t n1, const GGMLActs *a,
                             int64_t M, float *y, int64_t ld) {
    const int64_t K = a->K, B = K / BLOCK, row_bytes = ggml_row_bytes(type, K), lo = M * K;
    const int MIN = ggml_zero_shift(type) < 0 ? 1 + (type == GGML_Q2_K) : 0, SIGNED = !MIN; /* min types: unsigned codes */
    const int HALF = type == GGML_Q2_K || type == GGML_Q3_K || type == GGML_Q6_K, WIDEN = ggml_panel_widens(type);
    const float *xs = MIN == 2 ? a->xsum16 : a->xsum; /* XG sums a row */
    const int64_t XG = MIN == 2 ? K / 16 : B;
    int8_t *codes = aligned_alloc(64, 8 * K);
    float *s16 = malloc(sizeof(float) * K / 2), *mins = malloc(sizeof(float) * K / 2);
    int64_t n = n0;
    for (; n + GGML_PANEL_ROWS <= n1; n += GGML_PANEL_ROWS) {
        ggml_panel_pack(type, blocks + n * row_bytes, row_bytes, K, codes, s16, mins);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mr = M - m0 < 4 ? M - m0 : 4;
#define GGML_PANEL_KIND(S_, M_, H_, W_)                                                                              \
    if (SIGNED == S_ && MIN == M_ && HALF == H_ && WIDEN == W_) {                                                  \
        enum { SIGNED = S_, MIN = M_, HALF = H_, WIDEN = W_ };                                                     \
        WITH_PLANES(a->planes, switch (mr) { case 1: GGML_PANEL_CALL(1); break; case 2: GGML_PANEL_CALL(2); break; \
                                             case 3: GGML_PANEL_CALL(3); break; default: GGML_PANEL_CALL(4); });    \
    }
            GGML_PANEL_KIND(0, 1, 0, 0) /* Q4_1, Q4_K */
            GGML_PANEL_KIND(0, 1, 0, 1) /* Q5_1, Q5_K */
            GGML_PANEL_KIND(1, 0, 0, 0) /* Q4_0, Q5_0, MXFP4 */
            GGML_PANEL_KIND(1, 0, 0, 1) /* Q8_0, IQ4_NL, IQ4_XS */
            GGML_PANEL_KIND(1, 0, 1, 0) /* Q3_K, Q6_K */
            GGML_PANEL_KIND(0, 2, 1, 0) /* Q2_K */
#undef GGML_PANEL_KIND
        }
    }
    free(codes), free(s16), free(mins);
    if (n < n1) ggml_slice_avx2(type, blocks, n, n1, a, M, y + (n - n0), ld);
}

/* ---- VNNI batches: the same panels, two at a time, a dpbusd a step -------------------------------- */

/* Where VNNI runs without AMX tiles, a batch meets ggml_panel_pack's panels, two side by side (sixteen weight
 * rows, a 512-bit dpbusd for each step of four weights and activation row: no maddubs, no int16 sums to widen),
 * eight activation rows a pass (AVX-512's 32 registers hold their sums). Signed codes need no sign trick: the
 * high (or only) activation plane arrives as unsigned bytes x + 128 (ggml_pass_tile), meets the signed codes, and
 * 128 x the codes' sum per sixteen weights (ggml_panel_sums, made at packing) comes off. The rows
 * (ggml_slice_vnni) decode every block once per eight activation rows; a panel is decoded once per batch. */
VNNI static inline __attribute__((always_inline)) void ggml_panel_pair_vnni(
    const int8_t *codes0, const int8_t *codes1, const float *s16_0, const float *s16_1, const int32_t *sums0,
    const int32_t *sums1, const float *mins0, const float *mins1, const int8_t *xt, const float *dx, const float *xsum,
    int64_t K, __m512 *acc, const int MR, const int PL, const int SIGNED, const int MIN, const int HALF) {
    const int64_t B = K / BLOCK;
#define PAIR16(p0, p1) _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p0))), \
                                             _mm256_loadu_si256((const __m256i *)(p1)), 1)
#define PAIR16F(p0, p1) _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p0)), _mm256_loadu_ps(p1), 1)
    for (int64_t b = 0; b < B; b++) {
        const int8_t *xb = xt + b * MR * PL * BLOCK; /* row m's plane pl: xb + (m * PL + pl) * BLOCK */
        for (int h = 0; h < (HALF ? 2 : 1); h++) {
            const int STEPS = HALF ? 4 : 8;
            const int s0 = HALF ? 4 * h : 0;
            __m512i w[8], d[8];
#pragma GCC unroll 8
            for (int j = 0; j < STEPS; j++) w[j] = PAIR16(codes0 + b * 256 + (s0 + j) * 32, codes1 + b * 256 + (s0 + j) * 32);
            __m512i off = _mm512_setzero_si512(); /* 128 x the codes' sum: the unsigned high plane's excess */
            if (SIGNED) {
                off = PAIR16(sums0 + (2 * b + h) * 8, sums1 + (2 * b + h) * 8);
                if (!HALF) off = _mm512_add_epi32(off, PAIR16(sums0 + (2 * b + 1) * 8, sums1 + (2 * b + 1) * 8));
                off = _mm512_slli_epi32(off, 7);
            }
            /* One sum a row: the high (or only) plane's products, then, for 15-bit activations, that sum x 2^7 and the
             * low plane's products on top (the codes held in registers for both). */
            for (int pl = 0; pl < PL; pl++) {
                for (int m = 0; m < MR; m++)
                    d[m] = pl == 0 ? _mm512_setzero_si512() : _mm512_slli_epi32(SIGNED ? _mm512_sub_epi32(d[m], off) : d[m], 7);
#pragma GCC unroll 8
                for (int j = 0; j < STEPS; j++)
                    for (int m = 0; m < MR; m++) {
                        const __m512i x = _mm512_set1_epi32(*(const int32_t *)(xb + (m * PL + pl) * BLOCK + 4 * (s0 + j)));
                        d[m] = SIGNED ? _mm512_dpbusd_epi32(d[m], x, w[j]) : _mm512_dpbusd_epi32(d[m], w[j], x);
                    }
            }
            const __m512 ws = PAIR16F(s16_0 + (2 * b + h) * 8, s16_1 + (2 * b + h) * 8);
            for (int m = 0; m < MR; m++) {
                const __m512i dm = SIGNED && PL == 1 ? _mm512_sub_epi32(d[m], off) : d[m];
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dm), _mm512_mul_ps(ws, _mm512_set1_ps(dx[m * B + b])), acc[m]);
            }
        }
        if (MIN) {
            const __m512 mn = PAIR16F(mins0 + b * 8, mins1 + b * 8);
            for (int m = 0; m < MR; m++) acc[m] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(xsum[m * B + b]), acc[m]);
        }
    }
#undef PAIR16
#undef PAIR16F
}

/* A panel's codes summed per sixteen weights and row, [K / 16][8 rows]: a dpbusd of ones a step. */
VNNI static void ggml_panel_sums(const int8_t *codes, int64_t K, int32_t *sums) {
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t g = 0; g < K / 16; g++) {
        __m256i s = _mm256_setzero_si256();
        for (int step = 4 * (g % 2); step < 4 * (g % 2) + 4; step++)
            s = _mm256_dpbusd_epi32(s, ones, _mm256_loadu_si256((const __m256i *)(codes + (g / 2) * 256 + step * 32)));
        _mm256_storeu_si256((__m256i *)(sums + g * 8), s);
    }
}

/* Panels packed and walked together: each pass of eight activation rows meets them all from L2, where one panel a
 * pass streamed every activation row from L3 once per eight weight rows. */
#define VNNI_PANELS 4

/* Activation rows [m0, m0 + mr) as a pass reads them: per block of 32, each row's planes (high, then low) side by
 * side, [K / 32][mr][planes][32]; the high plane + 128 (`offset`: against signed codes). In place, rows K bytes
 * apart (a power of two) fell in one L1 set: sixteen streams of 15-bit activations thrashed its eight ways. */
VNNI static inline void ggml_pass_tile(const int8_t *qx, int64_t M, int64_t K, int planes, int64_t m0, int64_t mr,
                                       int offset, int8_t *xt) {
    const __m256i flip = _mm256_set1_epi8(offset ? (char)0x80 : 0);
    for (int64_t b = 0; b < K / BLOCK; b++)
        for (int64_t m = 0; m < mr; m++)
            for (int pl = 0; pl < planes; pl++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qx + pl * M * K + (m0 + m) * K + b * BLOCK));
                _mm256_storeu_si256((__m256i *)(xt + ((b * mr + m) * planes + pl) * BLOCK),
                                    pl == 0 ? _mm256_xor_si256(v, flip) : v);
            }
}

#define GGML_VNNI_PANEL_CALL(MR)                                                                                     \
    do {                                                                                                           \
        for (int64_t p = 0; p < np; p += 2) {                                                                      \
            const int64_t q = p + 1 < np ? p + 1 : p; /* an odd last panel: paired with itself, half kept */       \
            __m512 acc[8];                                                                                         \
            for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();                                             \
            ggml_panel_pair_vnni(codes + p * 8 * K, codes + q * 8 * K, s16 + p * K / 2, s16 + q * K / 2,           \
                                 sums + p * K / 2, sums + q * K / 2, mins + p * K / 2, mins + q * K / 2, xt,        \
                                 a->dx + m0 * B, a->xsum + m0 * B, K, acc, MR, PL, SIGNED, MIN, HALF);              \
            for (int m = 0; m < MR; m++)                                                                           \
                _mm512_mask_storeu_ps(y + (m0 + m) * ld + n + 8 * p - n0, q > p ? 0xFFFF : 0xFF, acc[m]);          \
        }                                                                                                          \
    } while (0)

/* Weight rows [n0, n1) of a ggml_wide_isas type against M activation rows (ggml_vnni_panels_pay), as ggml_slice:
 * eight weight rows a panel, VNNI_PANELS panels met by each pass of eight activation rows; the last weight rows
 * short of a panel by the rows. */
VNNI static void ggml_panels_vnni(int64_t type, const uint8_t *blocks, int64_t n0, int64_t n1, const GGMLActs *a,
                                  int64_t M, float *y, int64_t ld) {
    const int64_t K = a->K, B = K / BLOCK, row_bytes = ggml_row_bytes(type, K);
    const int MIN = ggml_zero_shift(type) < 0, SIGNED = !MIN, HALF = type == GGML_Q6_K;
    int8_t *codes = aligned_alloc(64, VNNI_PANELS * 8 * K), *xt = aligned_alloc(64, 8 * 2 * K);
    float *s16 = malloc(sizeof(float) * VNNI_PANELS * K / 2), *mins = malloc(sizeof(float) * VNNI_PANELS * K / 2);
    int32_t *sums = malloc(sizeof(int32_t) * VNNI_PANELS * K / 2);
    int64_t n = n0;
    for (; n + GGML_PANEL_ROWS <= n1; n += VNNI_PANELS * GGML_PANEL_ROWS) {
        const int64_t np = (n1 - n) / GGML_PANEL_ROWS < VNNI_PANELS ? (n1 - n) / GGML_PANEL_ROWS : VNNI_PANELS;
        for (int64_t p = 0; p < np; p++) {
            ggml_panel_pack(type, blocks + (n + 8 * p) * row_bytes, row_bytes, K, codes + p * 8 * K, s16 + p * K / 2,
                            mins + p * K / 2);
            if (SIGNED) ggml_panel_sums(codes + p * 8 * K, K, sums + p * K / 2);
        }
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const int64_t mr = M - m0 < 8 ? M - m0 : 8;
            ggml_pass_tile(a->qx, M, K, a->planes, m0, mr, SIGNED, xt);
#define GGML_VNNI_PANEL_KIND(S_, M_, H_)                                                                             \
    if (SIGNED == S_ && MIN == M_ && HALF == H_) {                                                                 \
        enum { SIGNED = S_, MIN = M_, HALF = H_ };                                                                 \
        WITH_PLANES(a->planes, FOR_ROWS_OF(mr, GGML_VNNI_PANEL_CALL_OF, ));                                        \
    }
#define GGML_VNNI_PANEL_CALL_OF(FN, MR) GGML_VNNI_PANEL_CALL(MR)
            GGML_VNNI_PANEL_KIND(0, 1, 0) /* Q4_1, Q5_1, Q4_K, Q5_K */
            GGML_VNNI_PANEL_KIND(1, 0, 0) /* Q4_0, Q5_0, Q8_0, IQ4_NL, IQ4_XS, MXFP4 */
            GGML_VNNI_PANEL_KIND(1, 0, 1) /* Q6_K */
#undef GGML_VNNI_PANEL_CALL_OF
#undef GGML_VNNI_PANEL_KIND
        }
        if (np < VNNI_PANELS) { n += np * GGML_PANEL_ROWS; break; }
    }
    free(codes), free(xt), free(s16), free(mins), free(sums);
    if (n < n1) { /* the rows short of a panel; Q6_K's rows read xsum16, which a batch for the panels went without */
        GGMLActs rows = *a;
        float *sums16 = type == GGML_Q6_K ? with_sums16(&rows, M) : NULL;
        ggml_slice_vnni(type, blocks, n, n1, &rows, M, y + (n - n0), ld);
        free(sums16);
    }
}
/* From 8 activation rows at 15 bits, 12 at int8: where a whole 1B-shaped model's matrices (Llama-3.2-1B Q4_K_M, from
 * memory) took less time as panels than as rows (Xeon without AMX, ms rows / panels: 15-bit 151 / 127 at 8 rows,
 * 103 / 113 at 6; int8 97 / 102 at 8, 149 / 127 at 12). */
static inline int ggml_vnni_panels_pay(int64_t M, int planes) { return M >= (planes == 2 ? 8 : 12); }

/* ---- F16 / BF16: the file's floats against the float activations --------------------------------- */

/* Eight weights at p as float32: float16 (SRC 1), bfloat16 (2) or float32 (0, a tile widened before). */
static inline __attribute__((always_inline)) __m256 float8(const uint8_t *p, const int SRC) {
    if (SRC == 0) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return SRC == 1 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* NR weight rows (w, `stride` bytes apart, SRC's floats) against MR activation rows x [MR, K] over their first kn
 * columns, into out[m * ld + r] (add: added to it): NR x MR float32 multiply-add chains, eight weights a step. */
static inline __attribute__((always_inline)) void float_run(const uint8_t *w, int64_t stride, const float *x, int64_t K,
                                                           int64_t kn, float *out, int64_t ld, int add, const int NR,
                                                           const int MR, const int SRC) {
    const int bytes = SRC == 0 ? 4 : 2;
    __m256 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MR; m++) acc[r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kn; k += 8) {
        __m256 v[4];
        for (int r = 0; r < NR; r++) v[r] = float8(w + r * stride + k * bytes, SRC);
        for (int m = 0; m < MR; m++) {
            const __m256 xm = _mm256_loadu_ps(x + m * K + k);
            for (int r = 0; r < NR; r++) acc[r][m] = _mm256_fmadd_ps(v[r], xm, acc[r][m]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MR; m++) out[m * ld + r] = (add ? out[m * ld + r] : 0.0f) + hsum(acc[r][m]);
}

#define FLOAT_CHUNK 1024 /* weights of each row a batch's tile widens to float32 at a time */

/* Weight rows a batch's tile holds: two fifths of the L2 cache at FLOAT_CHUNK floats a row (the rest for the
 * activation rows passing over it), runs of three, 15 to 60 rows. Every four activation rows read the tile's
 * chunk from L2 and their own from further out, so the larger the tile the fewer times the activations stream
 * (Zen 2, 512 KB: 51 rows; a 2,048 x 8,192 Q4_K matrix at 512 rows 125 GFLOP/s with tiles of 15 rows x 2,048,
 * 156 with 51 x 1,024). */
static inline int64_t float_tile_rows(void) {
    static int64_t rows = 0;
    if (!rows) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE), bytes = l2 > 0 ? l2 : 256 << 10;
        const int64_t fit = bytes * 2 / 5 / (int64_t)(sizeof(float) * FLOAT_CHUNK) / 3 * 3;
        rows = fit < 15 ? 15 : fit > 60 ? 60 : fit;
    }
    return rows;
}

/* Weights [k0, k1) of one row (row: the row's first byte) as float32 into w: the file's halves widened, or the
 * quantized blocks dequantized (ggml_unpack's codes times their scale, less their min: the row kernels' numbers). */
static void ggml_row_floats(int64_t type, const uint8_t *row, int64_t k0, int64_t k1, float *w) {
    if (ggml_half(type)) {
        for (int64_t k = k0; k < k1; k += 8)
            _mm256_storeu_ps(w + k - k0, type == GGML_F16 ? float8(row + 2 * k, 1) : float8(row + 2 * k, 2));
        return;
    }
    const int64_t W = ggml_block_weights(type), S = ggml_block_bytes(type), MG = type == GGML_Q2_K ? 16 : 32;
    int8_t codes[QK_K];
    float s16[16], m32[16];
    for (int64_t k = k0; k < k1; k += W) {
        ggml_unpack(type, row + k / W * S, codes, s16, m32);
        for (int64_t j = 0; j < W; j += 8) {
            const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + j))));
            _mm256_storeu_ps(w + k - k0 + j, _mm256_fmsub_ps(c, _mm256_set1_ps(s16[j / 16]), _mm256_set1_ps(m32[j / MG])));
        }
    }
}

/* float_run for NR (literal) weight rows at w against mr (1 .. 4) activation rows. */
#define FLOAT_RUN(NR, SRC)                                                                                          \
    switch (mr) {                                                                                                  \
    case 1: float_run(w, stride, xm, K, kn, out, ld, add, NR, 1, SRC); break;                                      \
    case 2: float_run(w, stride, xm, K, kn, out, ld, add, NR, 2, SRC); break;                                      \
    case 3: float_run(w, stride, xm, K, kn, out, ld, add, NR, 3, SRC); break;                                      \
    default: float_run(w, stride, xm, K, kn, out, ld, add, NR, 4, SRC); break;                                     \
    }

/* Weight rows [n0, n1) against M float activation rows, into y[m * ld + n - n0], in float32 on the weights as
 * floats: the products PyTorch's float GEMM would make on the dequantized weight. F16 / BF16 rows stream from the
 * file for up to four activation rows, four weight rows and two activation rows a run (decode: a pure read of the
 * weight). Otherwise each tile of float_tile_rows() rows is widened FLOAT_CHUNK weights at a time into float32
 * (ggml_row_floats: any type), and every four activation rows pass over it in cache, three weight rows a run
 * (twelve chains: enough to cover the multiply-add's latency on both pipes). */
static void ggml_float_slice(int64_t type, const uint8_t *blocks, int64_t n0, int64_t n1, const float *x, int64_t M,
                             int64_t K, float *y, int64_t ld) {
    const int64_t row_bytes = ggml_row_bytes(type, K);
    const int tiled = M > 4 || !ggml_half(type), src = type == GGML_F16 ? 1 : 2, NR = tiled ? 3 : 4, MR = tiled ? 4 : 2;
    const int64_t KC = tiled && K > FLOAT_CHUNK && FLOAT_CHUNK % ggml_block_weights(type) == 0 ? FLOAT_CHUNK : K;
    const int64_t rows = float_tile_rows();
    float *w32 = tiled ? aligned_alloc(64, sizeof(float) * rows * KC) : NULL;
    for (int64_t t0 = n0; t0 < n1; t0 += rows) {
        const int64_t t1 = t0 + rows < n1 ? t0 + rows : n1;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kn = k0 + KC < K ? KC : K - k0, stride = tiled ? 4 * KC : row_bytes;
            const int add = k0 > 0; /* a later chunk adds to the sums of the earlier ones */
            for (int64_t n = t0; tiled && n < t1; n++)
                ggml_row_floats(type, blocks + n * row_bytes, k0, k0 + kn, w32 + (n - t0) * KC);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int mr = M - m0 < MR ? (int)(M - m0) : MR;
                const float *xm = x + m0 * K + k0;
                for (int64_t n = t0; n < t1;) {
                    const uint8_t *w = tiled ? (const uint8_t *)(w32 + (n - t0) * KC) : blocks + n * row_bytes;
                    float *out = y + m0 * ld + n - n0;
                    const int whole = t1 - n >= NR;
                    if (tiled && whole) FLOAT_RUN(3, 0)
                    else if (tiled) FLOAT_RUN(1, 0)
                    else if (whole && src == 1) FLOAT_RUN(4, 1)
                    else if (whole) FLOAT_RUN(4, 2)
                    else if (src == 1) FLOAT_RUN(1, 1)
                    else FLOAT_RUN(1, 2)
                    n += whole ? NR : 1;
                }
            }
        }
    }
    free(w32);
}
#undef FLOAT_RUN

/* Whether M activation rows meet `type` as floats (ggml_float_slice): F16 / BF16 always; the quantized types
 * for a batch at the default two activation planes on AVX2, where the panels' two maddubs per 32 products make
 * them slower than float multiply-adds on the dequantized weight once enough rows share a dequantized tile (Zen 2,
 * 8,192 x 2,048, GFLOP/s panels / floats: Q4_K 127 / 127 at 64 rows, 137 / 152 at 128, 133 / 165 at 512; Q6_K
 * 103 / 102 at 32, 109 / 131 at 64; Q8_0 81 / 93 at 32). One plane (int8 activations) keeps the panels: 160-240
 * GFLOP/s. VNNI and AMX keep their integer rows and tiles. */
static inline int ggml_floats_pay(int vnni, int64_t type, int64_t M, int planes) {
    if (ggml_half(type)) return 1;
    if (planes == 1 || (vnni && ggml_wide_isas(type))) return 0;
    return M >= (ggml_panel_widens(type) || ggml_sums16(type) ? 64 : 128);
}

/* Weight rows [n0, n1) of one type against M activation rows, into y[m * ld + n - n0] (vnni: the CPU has it). */
static inline void ggml_slice(int vnni, int64_t type, const uint8_t *blocks, int64_t n0, int64_t n1, const GGMLActs *a,
                              int64_t M, float *y, int64_t ld) {
    if (ggml_floats_pay(vnni, type, M, a->planes)) {
        ggml_float_slice(type, blocks, n0, n1, a->x, M, a->K, y, ld);
        return;
    }
    (vnni && ggml_wide_isas(type) ? (ggml_vnni_panels_pay(M, a->planes) ? ggml_panels_vnni : ggml_slice_vnni)
     : ggml_panels_pay(type, M)    ? ggml_panels_avx2
                                   : ggml_slice_avx2)(type, blocks, n0, n1, a, M, y, ld);
}

/* Whether ggml_slice's rows of `type` read GGMLActs.xsum16: the AVX2 rows and panels of ggml_sums16's types, and
 * Q6_K's VNNI rows (its zero point's term; ggml_panels_vnni makes them for its last rows). */
static inline int ggml_slice_reads_sums16(int vnni, int64_t type, int64_t M, int planes) {
    if (!ggml_sums16(type) || ggml_floats_pay(vnni, type, M, planes)) return 0;
    return !(vnni && ggml_wide_isas(type)) || (type == GGML_Q6_K && !ggml_vnni_panels_pay(M, planes));
}
