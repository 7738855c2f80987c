/* Decode attention's pieces (layout: paged_attention.c), shared by paged_attention.c and decode_step.c. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

static inline float dot(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    return hsum(acc);
}

/* One sequence, one KV head, its `group` query heads; p: scratch of group * L floats. */
static void attend(const float *q, const float *keys, const float *values, const int64_t *table, int64_t first,
                   int64_t L, int64_t group, int64_t block_size, int64_t token_stride, int64_t block_stride,
                   int64_t D, float scale, float *p, float *out) {
    for (int64_t t = 0; t < L; t++) {
        int64_t pos = first + t;
        const float *k = keys + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
        for (int64_t h = 0; h < group; h++) p[h * L + t] = dot(q + h * D, k, D) * scale;
    }
    for (int64_t h = 0; h < group; h++) {
        float *ph = p + h * L, top = -INFINITY, total = 0;
        for (int64_t t = 0; t < L; t++) top = ph[t] > top ? ph[t] : top;
        for (int64_t t = 0; t < L; t++) total += (ph[t] = expf(ph[t] - top));
        for (int64_t t = 0; t < L; t++) ph[t] /= total;
    }
    memset(out, 0, sizeof(float) * group * D);
    for (int64_t t = 0; t < L; t++) {
        int64_t pos = first + t;
        const float *v = values + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
        for (int64_t h = 0; h < group; h++) {
            __m256 w = _mm256_set1_ps(p[h * L + t]);
            float *o = out + h * D;
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
        }
    }
}

/* RoPE (rotate-half) of one head vector in place, as PyTorch's x * cos + rotate_half(x) * sin: two
 * products and one add per element, never contracted into an FMA, so the bits are PyTorch's. */
__attribute__((optimize("fp-contract=off"))) static void rotate_half(float *x, const float *cos, const float *sin,
                                                                      int64_t D, float *tmp) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < D; i++) {
        float partner = i < half ? -x[i + half] : x[i - half];
        float a = x[i] * cos[i], b = partner * sin[i];
        tmp[i] = a + b;
    }
    memcpy(x, tmp, sizeof(float) * D);
}
