/* y[M, N] = x[M, K] @ W[N, K]^T in float32 for a few activation rows (2 <= M <= MAX_ROWS): a batched
 * decode step, or one sequence verifying speculative tokens. Such a product is bound by streaming W
 * from memory, yet MKL's sgemm takes 2-4x longer for M = 2..8 than its matrix-vector product for
 * M = 1 on this kind of CPU. Here each weight row is read once and used for all M rows (AVX2 + FMA,
 * two accumulators per row, OpenMP over output rows). Requires K % 16 == 0.
 */
#include <immintrin.h>
#include <stdint.h>

#include "float_rows.h"

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
