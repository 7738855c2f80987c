/* Low-bit weights in panels of PANEL output rows, for batches of activation rows (method: lowbit_gemm.c);
 * shared by lowbit_gemm.c and decode_step.c.
 *
 * Per block of 32 inputs, a panel holds its 8 rows' codes so that one 32-byte vector covers 4
 * consecutive inputs (a "quad") of every row — byte 4c + t is row c's input 4q + t — then their scales:
 *   INT4 (INT4_PANEL_BYTES): 4 vectors, vector j quad j in its low nibbles and quad j + 4 in its high
 *        ones; the rows' 8 scales, the rows' 8 offsets;
 *   INT8 (INT8_PANEL_BYTES): 8 vectors, quads 0..7; the rows' 8 scales of inputs 0-15, the 8 of 16-31
 *        (equal but where the group is 16, GGUF Q6_K's sub-blocks).
 * INT8 codes meeting 16-bit activations, on AVX2: the codes widened to int16 and the activations as
 * whole int16 codes (widen_planes): one _mm256_madd_epi16 multiplies 4 inputs of 4 rows, where the two
 * int8 planes would cost a sign trick and two byte multiply-adds per quad. On VNNI the two planes win
 * (a byte dot is one dpbusd there; SmolLM2's LM head, 49152 x 576, 2 threads: 16 rows 9.0-9.3 -> 6.1-6.6
 * ms, 31 rows 16.0-16.6 -> 11.3-14.4): WIDE_INT8 says which a tile takes.
 * The tiles read the activation rows as pack_tiles lays them out: with rows at run-time strides the
 * 8 (row, plane) addresses of a tile spilled the general registers (INT4 gate_up, 3072 x 576, 16-bit
 * blocks, one thread, VNNI: 141 -> 156-160 GFLOP/s at 16-128 rows, 127 -> 152-156 at 1,024; AVX2 83 -> 86).
 */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "lowbit_q8_rows.h"

#define PANEL 8
#define GEMM_ROWS 4 /* activation rows a tile takes: their int16 / int32 and float accumulators, the codes */
#define INT4_PANEL_BYTES (128 + 2 * PANEL * 4)
#define INT8_PANEL_BYTES (256 + 2 * PANEL * 4)
enum { PANEL_INT4 = 0, PANEL_INT8 = 1 };

/* Batches of at least this many rows take the panels (fewer: the row kernels; one: the batch-1 ones). */
#define PANEL_MIN_ROWS 2

/* The 4 bytes of an activation row at x as a vector of 8 copies. */
static inline __m256i quad_copies(const int8_t *x) { return _mm256_set1_epi32(*(const int32_t *)x); }

/* INT4 blocks (lowbit_panel_tile.h's int4_block_dots), per ISA: one quad's two unpacked code vectors
 * times a row's activation copies, added to its plane's sum, and a plane's sum as int32 dots. AVX2:
 * the unsigned codes (0..15) times |x| <= 127 give pair sums <= 3,810, so all 8 quads add in int16
 * (<= 30,480) before one widening multiply-add (times 128 for the high plane of two), as llama.cpp's
 * AVX2 Q4 dots do. */
static inline __m256i int4_quad_sum_avx2(__m256i sum, __m256i first, __m256i second, const int8_t *x) {
    const __m256i p = _mm256_maddubs_epi16(first, quad_copies(x));
    return _mm256_add_epi16(sum, _mm256_add_epi16(p, _mm256_maddubs_epi16(second, quad_copies(x + 16))));
}

static inline __m256i int4_plane_dots_avx2(__m256i sum, int high) { return _mm256_madd_epi16(sum, high ? HIGH16 : ONES16); }

/* acc + the byte products u (unsigned) x s (signed), four to a lane, per ISA (lowbit_panel_tile.h's
 * int8_block_dots); no pair sum saturates: 2 x 128 x 127 < 32,767. */
static inline __m256i byte_dot_avx2(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ONES16));
}

/* Activation rows' two int8 planes (high, low) as the int16 codes they hold: out[m * K + k] = 128 * hi + lo. */
static inline void widen_planes(const int8_t *qx, int64_t row_bytes, int64_t plane_bytes, int64_t M, int64_t K,
                                int16_t *out) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 16) {
            const int8_t *hi = qx + m * row_bytes + k;
            const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)hi));
            const __m256i l = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(hi + plane_bytes)));
            _mm256_storeu_si256((__m256i *)(out + m * K + k), _mm256_add_epi16(_mm256_slli_epi16(h, 7), l));
        }
}

/* INT8 codes against 16-bit blocks (lowbit_panel_tile.h's int8_block_dots_wide): acc + the pairwise
 * products of int16 lanes, per ISA. */
static inline __m256i wide_dot_avx2(__m256i acc, __m256i w, __m256i x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }

/* ---- AVX512-VNNI (256-bit dpbusd / dpwssd): the same integer dots, accumulated in int32 directly ---- */

/* acc + the byte products of u (unsigned) with the 4 bytes at x copied to every lane: dpbusd with the
 * copies as its embedded broadcast ({1to8}), one instruction where the compiler emits two. */
VNNI static inline __attribute__((always_inline)) __m256i dpbusd_quad(__m256i acc, __m256i u, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)x));
    return acc;
}

/* VNNI: each quad's codes times the copies in one dpbusd, in int32 at once; the high plane's dots
 * (times 128) shifted. */
VNNI static inline __attribute__((always_inline)) __m256i int4_quad_sum_vnni(__m256i sum, __m256i first, __m256i second,
                                                                            const int8_t *x) {
    return dpbusd_quad(dpbusd_quad(sum, first, x), second, x + 16);
}

VNNI static inline __m256i int4_plane_dots_vnni(__m256i sum, int high) { return high ? _mm256_slli_epi32(sum, 7) : sum; }

/* byte_dot_avx2's multiply-adds and add as one dpbusd. */
VNNI static inline __m256i byte_dot_vnni(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }

/* Both planes' PL and both kinds as constants, so each combination compiles to its own loops. */
#define WITH_PANEL_KIND(kind_value, ...)                                                                 \
    do {                                                                                                 \
        if ((kind_value) == PANEL_INT4) { enum { KIND = PANEL_INT4 }; __VA_ARGS__ }                      \
        else { enum { KIND = PANEL_INT8 }; __VA_ARGS__ }                                                 \
    } while (0)

#define ISA_CAT_(name, isa) name##_##isa
#define ISA_CAT(name, isa) ISA_CAT_(name, isa)
#define ISA avx2
#define ISA_ATTR
#define WIDE_INT8 1 /* INT8 x 16-bit blocks as int16 codes (widen_planes); else as two planes */
#include "lowbit_panel_tile.h"
#undef ISA
#undef ISA_ATTR
#undef WIDE_INT8
#define ISA vnni
#define ISA_ATTR VNNI
#define WIDE_INT8 0
#include "lowbit_panel_tile.h"
#undef ISA
#undef ISA_ATTR
#undef WIDE_INT8

/* Every row of M against panels [p0, p1) (panel_tiles), on VNNI where `vnni` and the CPU has it; qx as
 * pack_tiles lays it out (or widen_planes' int16 rows, for the AVX2 INT8 x 16-bit tiles). */
static inline void panel_rows(int vnni, int kind, int planes, const uint8_t *panels, int64_t p0, int64_t p1,
                              const int8_t *qx, const float *dx, const float *xsum, int64_t M, int64_t N, int64_t K,
                              float *y, int64_t ld, int64_t n0) {
    (vnni && use_vnni() ? panel_rows_vnni : panel_rows_avx2)(kind, planes, panels, p0, p1, qx, dx, xsum, M, N, K, y, ld,
                                                             n0);
}

/* Whether panel_rows takes a batch's rows as widen_planes' int16 codes (else as pack_tiles' tiles). */
static inline int panels_take_wide_rows(int vnni, int kind, int planes) {
    return kind == PANEL_INT8 && planes == 2 && !(vnni && use_vnni());
}

/* The activation rows' quantized planes (row m's plane pl at qx + m * row_bytes + pl * plane_bytes) as
 * the tiles read them: tile by tile (GEMM_ROWS rows; the last one what is left), block by block, each
 * row's planes side by side, so that one pointer and constant offsets reach a tile's bytes of a block
 * (rows at run-time strides spilled the general registers). out: M * planes * K bytes. */
static inline void pack_tiles(const int8_t *qx, int64_t row_bytes, int64_t plane_bytes, int64_t M, int64_t K,
                              int planes, int8_t *out) {
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_ROWS) {
        const int64_t rows = M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS;
        int8_t *tile = out + m0 * planes * K;
        for (int64_t b = 0; b < K / BLOCK; b++)
            for (int64_t r = 0; r < rows; r++)
                for (int pl = 0; pl < planes; pl++)
                    memcpy(tile + ((b * rows + r) * planes + pl) * BLOCK, qx + (m0 + r) * row_bytes + pl * plane_bytes + b * BLOCK,
                           BLOCK);
    }
}
