/* y[M, N] = x[M, K] @ W[N, K]^T in float32 for a few activation rows (2 <= M <= MAX_ROWS): a batched
 * decode step, or one sequence verifying speculative tokens. Such a product is bound by streaming W
 * from memory, yet MKL's sgemm takes 2-4x longer for M = 2..8 than its matrix-vector product for
 * M = 1 on this kind of CPU. Here each weight row is read once and used for all M rows (AVX2 + FMA,
 * two accumulators per row, OpenMP over output rows). Requires K % 16 == 0.
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

#define MAX_ROWS 8

/* MR is a literal at each call site: the loops over rows unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void output_row(
    const float *x, const float *w, float *y, int64_t n, int64_t N, int64_t K, const int MR) {
    __m256 a[MAX_ROWS], b[MAX_ROWS];
    for (int m = 0; m < MR; m++) { a[m] = _mm256_setzero_ps(); b[m] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < K; k += 16) {
        __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
        for (int m = 0; m < MR; m++) {
            a[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), a[m]);
            b[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), b[m]);
        }
    }
    for (int m = 0; m < MR; m++) y[m * N + n] = hsum(_mm256_add_ps(a[m], b[m]));
}


void small_batch_linear(const float *x, const float *W, float *y, int64_t M, int64_t N, int64_t K) {
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            switch (M) {
                case 1: output_row(x, W + n * K, y, n, N, K, 1); break;
                case 2: output_row(x, W + n * K, y, n, N, K, 2); break;
                case 3: output_row(x, W + n * K, y, n, N, K, 3); break;
                case 4: output_row(x, W + n * K, y, n, N, K, 4); break;
                case 5: output_row(x, W + n * K, y, n, N, K, 5); break;
                case 6: output_row(x, W + n * K, y, n, N, K, 6); break;
                case 7: output_row(x, W + n * K, y, n, N, K, 7); break;
                default: output_row(x, W + n * K, y, n, N, K, 8); break;
            }
        }
    }
}
