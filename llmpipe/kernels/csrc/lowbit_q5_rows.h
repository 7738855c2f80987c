/* GGUF Q5_0 weights read as the file holds them: each row K / 32 blocks of 22 bytes — the float16 scale d,
 * 4 bytes whose bit j is weight j's fifth bit, 16 bytes of nibbles (byte j: weight j low, j + 16 high) —
 * with w = d * (q - 16). The kernels unpack one or two rows at a time into int8 codes q - 16 and float32
 * scales (a scratch row that stays in L1) and hand them to the INT8 row functions, so the result is the
 * INT8 kernels' on those codes bit for bit, while the weight streams from memory at 0.69 bytes a weight
 * where int8 codes with float32 scales take 1.13 (Gemma 3 270M: 60% of its layers' weights are Q5_0).
 * On AVX512-VNNI, batch 1 (decode's hot path) skips the scratch row: q5_0_row_vnni_m1 below. */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "lowbit_q8_rows.h"

#define Q5_0_BLOCK_BYTES 22
#define Q5_0_PREFETCH_BYTES 4096 /* the rows stream from DRAM: as far ahead as the INT8 rows prefetch */

static inline int64_t q5_0_row_bytes(int64_t K) { return K / 32 * Q5_0_BLOCK_BYTES; }

/* A block's scale d (its first two bytes, float16). */
static inline float q5_0_scale(const uint8_t *b) {
    uint16_t d;
    memcpy(&d, b, 2);
    return _cvtsh_ss(d);
}

/* 32 bytes, byte j 0xFF where bit j of `bits` is set, else 0. */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i others = _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE); /* byte i: every bit but bit i */
    const __m256i v = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)bits), spread), others);
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

/* `rows` rows of Q5_0 blocks (K weights each) → codes [rows, K] (q - 16) and scales [rows, K / 32]. */
static inline void unpack_q5_0_rows(const uint8_t *blocks, int64_t rows, int64_t K, int8_t *codes, float *scales) {
    const __m256i low = _mm256_set1_epi8(0x0F), minus16 = _mm256_set1_epi8((char)0xF0);
    for (int64_t i = 0; i < rows * (K / 32); i++) {
        const uint8_t *b = blocks + i * Q5_0_BLOCK_BYTES;
        STREAM_PREFETCH(b + Q5_0_PREFETCH_BYTES);
        uint32_t fifth;
        memcpy(&fifth, b + 2, 4);
        scales[i] = q5_0_scale(b);
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 6));
        const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low);
        /* q - 16 in two's complement: the nibble where the fifth bit is set, the nibble | 0xF0 where not */
        const __m256i c = _mm256_or_si256(nibbles, _mm256_andnot_si256(bits_to_bytes(fifth), minus16));
        _mm256_storeu_si256((__m256i *)(codes + i * 32), c);
    }
}

/* ---- AVX512-VNNI, batch 1: the codes straight from the blocks -----------------------------------
 * A block's 32 codes q (0..31, unsigned: dpbusd's first operand as they stand) are its nibbles with 16
 * added where the fifth-bit word, read as a lane mask, is set. The -16 of w = d (q - 16) meets the
 * activations, not the weights: q5_0_bias holds -16 x the sum of each four activation bytes (dpbusd's
 * lane groups) per plane, once per op, as the accumulator every row's dpbusd starts from. Each lane
 * then holds the integer the INT8 rows compute on the unpacked codes q - 16, and the float steps are
 * int8_rows_vnni_m1's with one row (group 32): the same result, bit for bit, with no scratch row. */

VNNI static inline __m256i q5_0_codes(const uint8_t *b) {
    uint32_t fifth;
    memcpy(&fifth, b + 2, 4);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 6));
    const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
    return _mm256_mask_add_epi8(nibbles, (__mmask32)fifth, nibbles, _mm256_set1_epi8(16));
}

/* bias[p * K / 4 + i] = -16 x (the sum of activation bytes 4i .. 4i + 3 of plane p), for PL planes
 * (plane p at qx + p * lo). */
VNNI static inline void q5_0_bias(const int8_t *qx, int64_t K, int64_t lo, const int PL, int32_t *bias) {
    const __m256i sixteen = _mm256_set1_epi8(16);
    for (int p = 0; p < PL; p++)
        for (int64_t k = 0; k < K; k += BLOCK) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qx + p * lo + k));
            const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), sixteen, x);
            _mm256_storeu_si256((__m256i *)(bias + p * (K / 4) + k / 4), _mm256_sub_epi32(_mm256_setzero_si256(), sums));
        }
}

/* The dot of one activation row (planes PL, the low one at qx + lo) with one Q5_0 row of K weights. */
VNNI static inline float q5_0_row_vnni_m1(const uint8_t *row, const int8_t *qx, const float *dx, const int32_t *bias,
                                          int64_t K, int64_t lo, const int PL) {
    const int64_t B = K / BLOCK;
    const int32_t *bias_lo = bias + K / 4;
    __m512 acc = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 1 < B; c += 2) {
        const uint8_t *b = row + c * Q5_0_BLOCK_BYTES;
        STREAM_PREFETCH(b + Q5_0_PREFETCH_BYTES);
        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(q5_0_codes(b)), q5_0_codes(b + Q5_0_BLOCK_BYTES), 1);
        __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512(bias + c * 8), w, _mm512_loadu_si512(qx + c * BLOCK));
        if (PL == 2)
            d = _mm512_dpbusd_epi32(_mm512_add_epi32(_mm512_slli_epi32(d, 7), _mm512_loadu_si512(bias_lo + c * 8)), w,
                                    _mm512_loadu_si512(qx + lo + c * BLOCK));
        const __m512 k = _mm512_mul_ps(lane_halves(q5_0_scale(b), q5_0_scale(b + Q5_0_BLOCK_BYTES)), pair_lanes(dx + c));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), k, acc);
    }
    float out = _mm512_reduce_add_ps(acc);
    if (c < B) { /* an odd block count: the last one at 256 bits */
        const uint8_t *b = row + c * Q5_0_BLOCK_BYTES;
        const __m256i w = q5_0_codes(b);
        __m256i d = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(bias + c * 8)), w,
                                        _mm256_loadu_si256((const __m256i *)(qx + c * BLOCK)));
        if (PL == 2)
            d = _mm256_dpbusd_epi32(_mm256_add_epi32(_mm256_slli_epi32(d, 7), _mm256_loadu_si256((const __m256i *)(bias_lo + c * 8))),
                                    w, _mm256_loadu_si256((const __m256i *)(qx + lo + c * BLOCK)));
        out += dx[c] * hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(q5_0_scale(b))));
    }
    return out;
}
