/* y[M, N] = x[M, K] @ W^T for a weight held as ggml's quantized blocks (ggml_rows.h) in segments of rows of one
 * type each (a stacked layer's q, k and v; gate and up), x quantized here once to `bits` 8 (one plane) or 16
 * (two planes) blocks of 32, any M; each thread owns a run of output rows across the segments. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "ggml_amx.h"
#include "ggml_rows.h"

int ggml_type_supported(int64_t type) { return ggml_supported(type); }

/* Bytes of a row of K weights; 0 where K is not whole blocks (the op refuses it). */
int64_t ggml_row_bytes_of(int64_t type, int64_t K) { return K % ggml_block_weights(type) ? 0 : ggml_row_bytes(type, K); }

int ggml_has_amx(void) { return use_amx(); }

/* y [M, N] = x [M, K] @ W^T, W's rows in `n` segments (table: ggml type, rows, address of its blocks
 * [rows, ggml_row_bytes(type, K)] per segment); `isa` 0 forces AVX2, 1 the AVX512-VNNI rows, 2 (the default)
 * AMX tiles for batches of AMX_MIN_ROWS rows or more (each where present). */
void ggml_segments_dot(const float *x, const int64_t *table, int64_t n, float *y, int64_t M, int64_t N, int64_t K,
                       int64_t bits, int64_t isa) {
    const int planes = bits == 16 ? 2 : 1, vnni = isa && use_vnni();
    const int codes = ggml_segments_read_codes(table, n, M, planes, vnni);
    const int amx = codes && isa >= 2 && M >= AMX_MIN_ROWS && use_amx();
    int8_t *qx = codes ? malloc(activation_bytes(M, K, planes)) : NULL;
    float *dx = codes ? malloc(sizeof(float) * M * (K / BLOCK)) : NULL, *xsum = codes ? malloc(sizeof(float) * M * (K / BLOCK)) : NULL;
    int32_t *s4 = codes && !amx ? malloc(sizeof(int32_t) * M * (K / 4)) : NULL;
    int8_t *b = amx ? aligned_alloc(64, amx_act_bytes(M, K, planes)) : NULL;
    float *dxt = amx ? malloc(sizeof(float) * amx_act_floats(M, K)) : NULL;
    float *xst = amx ? malloc(sizeof(float) * amx_act_floats(M, K)) : NULL;
    if (codes) { /* sixteen rows at a time, each laid out for the tiles as soon as it is quantized */
#pragma omp parallel for schedule(static) if (M >= 2 * AMX_ROWS)
        for (int64_t t = 0; t < amx_tiles(M); t++) {
            quantize_row_range(x, M, t * AMX_ROWS, t * AMX_ROWS + AMX_ROWS < M ? t * AMX_ROWS + AMX_ROWS : M, K, BLOCK,
                               planes, qx, dx, xsum);
            if (amx) amx_pack(qx, dx, xsum, M, K, planes, t, t + 1, b, dxt, xst);
        }
    }
    if (codes && !amx && vnni) activation_sums4(qx, M, K, planes, s4); /* only the VNNI rows read s4 */
    const GGMLActs a = {qx, dx, xsum, s4, K, planes, .x = x};
    const AmxActs tiles = {b, dxt, xst, M, amx_tiles(M), K, planes};
#pragma omp parallel
    {
        int64_t n0, n1;
        thread_rows(N, amx ? AMX_ROWS : 4, &n0, &n1);
        if (n0 < n1) ggml_segment_rows(table, n, n0, n1, &a, amx ? &tiles : NULL, M, vnni, y + n0, N);
    }
    free(qx), free(dx), free(xsum), free(s4), free(b), free(dxt), free(xst);
}

/* One segment: W ggml blocks of `type` [N, ggml_row_bytes(type, K)]. */
void ggml_linear_dot(const float *x, const uint8_t *blocks, float *y, int64_t M, int64_t N, int64_t K, int64_t type,
                     int64_t bits, int64_t isa) {
    const int64_t table[3] = {type, N, (int64_t)(uintptr_t)blocks};
    ggml_segments_dot(x, table, 1, y, M, N, K, bits, isa);
}
