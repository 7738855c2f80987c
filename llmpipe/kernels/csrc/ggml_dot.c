/* y[M, N] = x[M, K] @ W^T for a weight held as ggml's quantized blocks (ggml_rows.h), x quantized here to
 * `bits` 8 (one plane) or 16 (two planes) blocks of 32, any M; each thread owns a run of output rows. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "ggml_amx.h"
#include "ggml_rows.h"

/* y [M, N] of one weight's rows, each thread its own run of them (ggml_slice). */
static void ggml_rows(int64_t type, const uint8_t *blocks, const GGMLActs *a, float *y, int64_t M, int64_t N, int vnni) {
#pragma omp parallel
    {
        int64_t n0, n1;
        thread_rows(N, 4, &n0, &n1);
        if (n0 < n1) ggml_slice(vnni, type, blocks, n0, n1, a, M, y + n0, N);
    }
}

int ggml_type_supported(int64_t type) { return ggml_supported(type); }

/* Bytes of a row of K weights; 0 where K is not whole blocks (the op refuses it). */
int64_t ggml_row_bytes_of(int64_t type, int64_t K) { return K % ggml_block_weights(type) ? 0 : ggml_row_bytes(type, K); }

/* y [M, N] of one weight's rows on AMX tiles, each thread its own run of sixteen-row tiles. */
static void ggml_amx_rows(int64_t type, const uint8_t *blocks, const int8_t *qx, const float *dx, const float *xsum,
                          float *y, int64_t M, int64_t N, int64_t K, int planes) {
    int8_t *b = aligned_alloc(64, amx_act_bytes(M, K, planes));
    float *dxt = malloc(sizeof(float) * amx_act_floats(M, K)), *xst = malloc(sizeof(float) * amx_act_floats(M, K));
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < amx_tiles(M); t++) amx_pack(qx, dx, xsum, M, K, planes, t, t + 1, b, dxt, xst);
    const AmxActs a = {b, dxt, xst, M, amx_tiles(M), K, planes};
#pragma omp parallel
    {
        int64_t n0, n1;
        thread_rows(N, AMX_ROWS, &n0, &n1);
        if (n0 < n1) ggml_amx_slice(type, blocks, n0, n1, &a, y + n0, N);
    }
    free(b), free(dxt), free(xst);
}

int ggml_has_amx(void) { return use_amx(); }

/* y [M, N] = x [M, K] @ W^T, W ggml blocks of `type` [N, ggml_row_bytes(type, K)]; `isa` 0 forces AVX2, 1 the
 * AVX512-VNNI rows, 2 (the default) AMX tiles for batches of AMX_MIN_ROWS rows or more (each where present). */
void ggml_linear_dot(const float *x, const uint8_t *blocks, float *y, int64_t M, int64_t N, int64_t K, int64_t type,
                     int64_t bits, int64_t isa) {
    const int planes = bits == 16 ? 2 : 1, vnni = isa && use_vnni();
    int8_t *qx = malloc(activation_bytes(M, K, planes));
    float *dx = malloc(sizeof(float) * M * (K / BLOCK)), *xsum = malloc(sizeof(float) * M * (K / BLOCK));
    int32_t *s4 = malloc(sizeof(int32_t) * M * (K / 4));
    quantize_rows(x, M, K, BLOCK, planes, qx, dx, xsum);
    if (isa >= 2 && M >= AMX_MIN_ROWS && use_amx()) {
        ggml_amx_rows(type, blocks, qx, dx, xsum, y, M, N, K, planes);
    } else {
        activation_sums4(qx, M, K, planes, s4);
        const GGMLActs a = {qx, dx, xsum, s4, K, planes};
        ggml_rows(type, blocks, &a, y, M, N, vnni);
    }
    free(qx), free(dx), free(xsum), free(s4);
}
