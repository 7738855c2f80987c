/* AVX2 helpers shared by llmpipe's C kernels (compiled with -I pointing here). */
#pragma once
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "abi.h" /* MAX_ROWS: activation rows per call (the caller splits larger batches) */
/* The one weight group narrower than a 32-element chunk: INT8 only, two scales a chunk (GGUF Q6_K). */
#define HALF_GROUP 16

/* Weight groups of a K-wide row: the last may be narrower than `group`. */
static inline int64_t num_groups(int64_t K, int64_t group) { return (K + group - 1) / group; }
static inline int64_t group_end(int64_t g, int64_t K, int64_t group) { return (g + 1) * group < K ? (g + 1) * group : K; }

/* The sum of a vector's eight floats. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* CALL(MR) for the row count M (1..8) as a literal, so loops over rows unroll at every call site. */
#define FOR_ROWS(M, CALL)                                   \
    switch (M) {                                            \
    case 1: CALL(1); break; case 2: CALL(2); break;         \
    case 3: CALL(3); break; case 4: CALL(4); break;         \
    case 5: CALL(5); break; case 6: CALL(6); break;         \
    case 7: CALL(7); break; default: CALL(8); break;        \
    }

/* Inside a parallel region: this thread's share [n0, n1) of N rows, cut at multiples of `align`. */
static inline void thread_rows(int64_t N, int64_t align, int64_t *n0, int64_t *n1) {
    const int64_t nth = omp_get_num_threads(), units = (N + align - 1) / align, per = (units + nth - 1) / nth;
    const int64_t start = omp_get_thread_num() * per * align, end = start + per * align;
    *n0 = start < N ? start : N;
    *n1 = end < N ? end : N;
}

