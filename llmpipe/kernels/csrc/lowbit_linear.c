/* Fused dequantize-matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T with W held as 4- or 8-bit
 * codes and float32 group scales, accumulated in float32 (AVX2 + FMA, OpenMP over output rows).
 *
 * int4: W[n, k] = code * scale[n, g] + offset[n, g], g = k / group. Codes are packed per 32-element
 *       chunk of a row as 16 bytes: byte j holds element j in its low nibble and j + 16 in its high
 *       one (ggml's Q4 order, so GGUF Q4_0 / Q4_1 bytes are already in this layout).
 * int8: W[n, k] = code * scale[n, g].
 * Requires K % 32 == 0, group % 32 == 0, M <= MAX_ROWS (the caller pads / splits). The last group
 * may be narrower than `group` (SmolLM2's K = 576 at group 128): ceil(K / group) groups per row.
 * int4_dequantize / int8_dequantize write W itself out, for the float GEMM of long prefill chunks.
 * A single activation row (batch-1 decode) takes two output rows at a time with four accumulators
 * each: eight independent FMA chains, where one row's two would wait on FMA latency.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "lowbit_float_rows.h"
#include "lowbit_q5_rows.h"

void int4_linear(const float *x, const uint8_t *codes, const float *scale, const float *offset, float *y,
                 int64_t M, int64_t N, int64_t K, int64_t group) {
    const int64_t G = num_groups(K, group);
    float *xsum = malloc(sizeof(float) * M * G); /* the offset term: offset[n, g] * sum of x over group g */
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0;
            for (int64_t k = g * group; k < group_end(g, K, group); k++) s += x[m * K + k];
            xsum[m * G + g] = s;
        }
    if (M == 1) {
        _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < N - 1; n += 2)
            int4_pair(x, codes + n * (K / 2), scale + n * G, offset + n * G, xsum, y + n, K, group);
        if (N % 2) int4_row(x, codes + (N - 1) * (K / 2), scale + (N - 1) * G, offset + (N - 1) * G, xsum, y, N - 1, N, K, group, 1);
    } else {
#define INT4_ROWS(MR)                                                                              \
    _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < N; n++)                   \
        int4_row(x, codes + n * (K / 2), scale + n * G, offset + n * G, xsum, y, n, N, K, group, MR)
        FOR_ROWS(M, INT4_ROWS)
    }
    free(xsum);
}

void int8_linear(const float *x, const int8_t *codes, const float *scale, float *y,
                 int64_t M, int64_t N, int64_t K, int64_t group) {
    const int64_t G = num_groups(K, group);
    if (M == 1) {
        _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < N - 1; n += 2)
            int8_pair(x, codes + n * K, scale + n * G, y + n, K, group);
        if (N % 2) int8_row(x, codes + (N - 1) * K, scale + (N - 1) * G, y, N - 1, N, K, group, 1);
        return;
    }
#define INT8_ROWS(MR)                                                                              \
    _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < N; n++)                   \
        int8_row(x, codes + n * K, scale + n * G, y, n, N, K, group, MR)
    FOR_ROWS(M, INT8_ROWS)
}

/* int8_linear's loops over Q5_0 blocks (lowbit_q5_rows.h): each thread unpacks the rows it takes, pairs
 * at batch 1, into its scratch rows, then runs int8_linear's row functions on them. */
void q5_0_linear(const float *x, const uint8_t *blocks, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t G = K / 32, row_bytes = q5_0_row_bytes(K);
#pragma omp parallel
    {
        int8_t *codes = malloc(2 * K);
        float *scale = malloc(sizeof(float) * 2 * G);
        if (M == 1) {
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N - 1; n += 2) {
                unpack_q5_0_rows(blocks + n * row_bytes, 2, K, codes, scale);
                int8_pair(x, codes, scale, y + n, K, 32);
            }
#pragma omp single
            if (N % 2) {
                unpack_q5_0_rows(blocks + (N - 1) * row_bytes, 1, K, codes, scale);
                int8_row(x, codes, scale, y, N - 1, N, K, 32, 1);
            }
        } else {
#define Q5_0_ROWS(MR)                                                                              \
    _Pragma("omp for schedule(static)") for (int64_t n = 0; n < N; n++) {                          \
        unpack_q5_0_rows(blocks + n * row_bytes, 1, K, codes, scale);                              \
        int8_row(x, codes, scale, y, n, N, K, 32, MR);                                             \
    }
            FOR_ROWS(M, Q5_0_ROWS)
        }
        free(codes), free(scale);
    }
}

/* Q5_0 blocks [N, K / 32 * 22] → codes q - 16 [N, K] and scales [N, K / 32] (the INT8 form of the weight). */
void q5_0_unpack(const uint8_t *blocks, int8_t *codes, float *scale, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) unpack_q5_0_rows(blocks + n * q5_0_row_bytes(K), 1, K, codes + n * K, scale + n * (K / 32));
}

/* W itself, as float32 [N, K] (the float GEMM of long prefill chunks multiplies by it): code * scale, then
 * + offset — two roundings, never contracted into an FMA, so the bits are PyTorch's (quant/linear.py's
 * kernel_weight). One pass, output rows shared over the threads. */
__attribute__((optimize("fp-contract=off"))) void int4_dequantize(const uint8_t *codes, const float *scale,
                                                                   const float *offset, float *w, int64_t N,
                                                                   int64_t K, int64_t group) {
    const int64_t G = num_groups(K, group);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < K; c += 32) {
            const __m256 s = _mm256_set1_ps(scale[n * G + c / group]), o = _mm256_set1_ps(offset[n * G + c / group]);
            __m256 v[4];
            int4_chunk(codes + n * (K / 2) + c / 2, v);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(w + n * K + c + 8 * i, _mm256_add_ps(_mm256_mul_ps(v[i], s), o));
        }
}

void int8_dequantize(const int8_t *codes, const float *scale, float *w, int64_t N, int64_t K, int64_t group) {
    const int64_t G = num_groups(K, group);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k += 8) {
            const __m128i c = _mm_loadl_epi64((const __m128i *)(codes + n * K + k));
            _mm256_storeu_ps(w + n * K + k, _mm256_mul_ps(sbytes_to_float(c), _mm256_set1_ps(scale[n * G + k / group])));
        }
}
