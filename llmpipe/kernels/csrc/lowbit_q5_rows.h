/* GGUF Q5_0 weights read as the file holds them: each row K / 32 blocks of 22 bytes — the float16 scale d,
 * 4 bytes whose bit j is weight j's fifth bit, 16 bytes of nibbles (byte j: weight j low, j + 16 high) —
 * with w = d * (q - 16). The kernels unpack one or two rows at a time into int8 codes q - 16 and float32
 * scales (a scratch row that stays in L1) and hand them to the INT8 row functions, so the result is the
 * INT8 kernels' on those codes bit for bit, while the weight streams from memory at 0.69 bytes a weight
 * where int8 codes with float32 scales take 1.13 (Gemma 3 270M: 60% of its layers' weights are Q5_0). */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define Q5_0_BLOCK_BYTES 22
#define Q5_0_PREFETCH_BYTES 4096 /* the rows stream from DRAM: as far ahead as the INT8 rows prefetch */

static inline int64_t q5_0_row_bytes(int64_t K) { return K / 32 * Q5_0_BLOCK_BYTES; }

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
        _mm_prefetch((const char *)(b + Q5_0_PREFETCH_BYTES), _MM_HINT_T0);
        uint16_t d;
        uint32_t fifth;
        memcpy(&d, b, 2), memcpy(&fifth, b + 2, 4);
        scales[i] = _cvtsh_ss(d);
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 6));
        const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low);
        /* q - 16 in two's complement: the nibble where the fifth bit is set, the nibble | 0xF0 where not */
        const __m256i c = _mm256_or_si256(nibbles, _mm256_andnot_si256(bits_to_bytes(fifth), minus16));
        _mm256_storeu_si256((__m256i *)(codes + i * 32), c);
    }
}
