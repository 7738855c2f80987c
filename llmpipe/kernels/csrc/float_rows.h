/* The float32 row kernel of small_batch_linear.c, shared with decode_step.c. */
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

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
