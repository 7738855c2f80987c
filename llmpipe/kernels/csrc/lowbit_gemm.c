/* Batched low-bit matmul with integer dot products (prefill chunks, decode batches of many sequences):
 * y[M, N] = x[M, K] @ W[N, K]^T with W's INT4 or INT8 codes repacked into panels of PANEL output rows, so one
 * register of 32 bytes holds 4 consecutive inputs of each of the panel's 8 rows. Broadcasting the
 * matching 4 activation bytes of a row and one _mm256_maddubs_epi16 then gives 32 products for the 8
 * outputs at once; no horizontal sum is left to do, and each weight byte loaded serves GEMM_ROWS rows.
 * The activations are quantized once (lowbit_q8_rows.h: quantize_rows, 8 bits or 15 as two planes),
 * so the result is the row kernels' (lowbit_dot.c) to float32 rounding: the same integer dots, the
 * same scales.
 *
 * The panels' layout and the integer arithmetic per kind: lowbit_panels.h. INT8 codes (GGUF Q8_0, Q5_0,
 * Q6_K's sub-blocks of 16) take the same panels with a byte a code.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "lowbit_panels.h"

/* y[M, N] (any M) = x[M, K] @ W^T, x quantized here to `bits` 8 or 16; panels [ceil(N / 8), K / 32,
 * INT4_PANEL_BYTES or INT8_PANEL_BYTES] (kernels/ops.py lays them out). Requires K % 32 == 0. `isa`: 0
 * AVX2, 1 VNNI where the CPU has it (the same integers either way). */
static void gemm_dot(int kind, const float *x, const uint8_t *panels, float *y, int64_t M, int64_t N, int64_t K,
                     int64_t bits, int64_t isa) {
    const int planes = bits == 16 ? 2 : 1;
    const int64_t B = K / BLOCK, P = (N + PANEL - 1) / PANEL;
    int8_t *qx = malloc(activation_bytes(M, K, planes));
    float *dx = malloc(sizeof(float) * M * B), *xsum = malloc(sizeof(float) * M * B);
    /* row m's planes at qx + m * planes * K: one row per call, so the rows quantize in parallel */
    _Pragma("omp parallel for schedule(static)") for (int64_t m = 0; m < M; m++)
        quantize_rows(x + m * K, 1, K, BLOCK, planes, qx + m * planes * K, dx + m * B, xsum + m * B);
    int8_t *rows = malloc(activation_bytes(M, K, planes)); /* the tiles (or int16 codes) panel_rows reads */
    if (panels_take_wide_rows(isa, kind, planes))
        widen_planes(qx, planes * K, K, M, K, (int16_t *)rows);
    else
        pack_tiles(qx, planes * K, K, M, K, planes, rows);
    /* Threads take whole panels: a panel's codes (B blocks) stay in L1 across the row tiles. */
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) panel_rows(isa, kind, planes, panels, p, p + 1, rows, dx, xsum, M, N, K, y, N, 0);
    free(qx), free(dx), free(xsum), free(rows);
}

void int4_gemm_dot(const float *x, const uint8_t *panels, float *y, int64_t M, int64_t N, int64_t K, int64_t bits,
                   int64_t isa) {
    gemm_dot(PANEL_INT4, x, panels, y, M, N, K, bits, isa);
}

void int8_gemm_dot(const float *x, const uint8_t *panels, float *y, int64_t M, int64_t N, int64_t K, int64_t bits,
                   int64_t isa) {
    gemm_dot(PANEL_INT8, x, panels, y, M, N, K, bits, isa);
}
