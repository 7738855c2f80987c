/* Row kernels of the float-activation low-bit matmul (layout and math: lowbit_linear.c), shared
 * by lowbit_linear.c and decode_step.c. */
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

#define PREFETCH_BYTES 4096


/* The 32 weights of one chunk's 16 code bytes as 4 × 8 floats (unscaled codes 0..15). The bytes go
 * to both 128-bit lanes, so one in-lane byte shuffle puts 8 consecutive codes into 8 int32 lanes:
 * 4 shuffles a chunk, where widening from the low bytes of a register needs 2 more to shift them down. */
static inline __attribute__((always_inline)) void int4_chunk(const uint8_t *bytes, __m256 w[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                           4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i second = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                            12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes));
    __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    w[0] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, first));
    w[1] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, second));
    w[2] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, first));
    w[3] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, second));
}

static inline __m256 sbytes_to_float(__m128i bytes8) { /* low 8 signed bytes → 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8));
}

/* ga[m] / gb[m] += one 32-element chunk of weights (w0..w3) times row m of x (xc = x + chunk start). */
static inline __attribute__((always_inline)) void chunk_fma(
    __m256 w0, __m256 w1, __m256 w2, __m256 w3, const float *xc, int64_t K, __m256 *ga, __m256 *gb, const int MR) {
    for (int m = 0; m < MR; m++, xc += K) {
        ga[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xc), ga[m]);
        gb[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xc + 8), gb[m]);
        ga[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xc + 16), ga[m]);
        gb[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xc + 24), gb[m]);
    }
}

/* One output row n for MR activation rows; MR is a literal at every call site, so after inlining
 * the loops over rows unroll and the accumulators stay in registers. Two accumulators per row
 * halve the FMA dependency chains. */
static inline __attribute__((always_inline)) void int4_row(
    const float *x, const uint8_t *row, const float *scale, const float *offset, const float *xsum,
    float *y, int64_t n, int64_t N, int64_t K, int64_t group, const int MR) {
    const int64_t G = num_groups(K, group);
    __m256 acc[MAX_ROWS];
    float off[MAX_ROWS];
    for (int m = 0; m < MR; m++) { acc[m] = _mm256_setzero_ps(); off[m] = 0; }
    for (int64_t g = 0; g < G; g++) {
        __m256 ga[MAX_ROWS], gb[MAX_ROWS];
        for (int m = 0; m < MR; m++) { ga[m] = _mm256_setzero_ps(); gb[m] = _mm256_setzero_ps(); }
        for (int64_t c = g * group; c < group_end(g, K, group); c += 32) {
            __m256 w[4];
            int4_chunk(row + c / 2, w);
            chunk_fma(w[0], w[1], w[2], w[3], x + c, K, ga, gb, MR);
        }
        __m256 s = _mm256_set1_ps(scale[g]);
        for (int m = 0; m < MR; m++) {
            acc[m] = _mm256_fmadd_ps(_mm256_add_ps(ga[m], gb[m]), s, acc[m]);
            off[m] += offset[g] * xsum[m * G + g];
        }
    }
    for (int m = 0; m < MR; m++) y[m * N + n] = hsum(acc[m]) + off[m];
}

/* int8_row for HALF_GROUP: each 16 weights their own scale. */
static inline __attribute__((always_inline)) void int8_row_halves(
    const float *x, const int8_t *row, const float *scale, float *y, int64_t n, int64_t N, int64_t K, const int MR) {
    __m256 acc[MAX_ROWS];
    for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / HALF_GROUP; g++) {
        const int64_t c = g * HALF_GROUP;
        const __m128i b = _mm_loadu_si128((const __m128i *)(row + c));
        const __m256 w0 = sbytes_to_float(b), w1 = sbytes_to_float(_mm_srli_si128(b, 8)), s = _mm256_set1_ps(scale[g]);
        for (int m = 0; m < MR; m++) {
            const float *xc = x + m * K + c;
            const __m256 part = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xc + 8), _mm256_mul_ps(w0, _mm256_loadu_ps(xc)));
            acc[m] = _mm256_fmadd_ps(part, s, acc[m]);
        }
    }
    for (int m = 0; m < MR; m++) y[m * N + n] = hsum(acc[m]);
}

static inline __attribute__((always_inline)) void int8_row(
    const float *x, const int8_t *row, const float *scale, float *y, int64_t n, int64_t N, int64_t K,
    int64_t group, const int MR) {
    if (group == HALF_GROUP) { int8_row_halves(x, row, scale, y, n, N, K, MR); return; }
    const int64_t G = num_groups(K, group);
    __m256 acc[MAX_ROWS];
    for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 ga[MAX_ROWS], gb[MAX_ROWS];
        for (int m = 0; m < MR; m++) { ga[m] = _mm256_setzero_ps(); gb[m] = _mm256_setzero_ps(); }
        for (int64_t c = g * group; c < group_end(g, K, group); c += 32) {
            __m128i b0 = _mm_loadu_si128((const __m128i *)(row + c));
            __m128i b1 = _mm_loadu_si128((const __m128i *)(row + c + 16));
            __m256 w0 = sbytes_to_float(b0), w1 = sbytes_to_float(_mm_srli_si128(b0, 8));
            __m256 w2 = sbytes_to_float(b1), w3 = sbytes_to_float(_mm_srli_si128(b1, 8));
            chunk_fma(w0, w1, w2, w3, x + c, K, ga, gb, MR);
        }
        __m256 s = _mm256_set1_ps(scale[g]);
        for (int m = 0; m < MR; m++) acc[m] = _mm256_fmadd_ps(_mm256_add_ps(ga[m], gb[m]), s, acc[m]);
    }
    for (int m = 0; m < MR; m++) y[m * N + n] = hsum(acc[m]);
}

/* One activation row (batch-1 decode), output rows n and n + 1: 8 weights a step per accumulator. */
static inline void int4_pair(const float *x, const uint8_t *row, const float *scale, const float *offset,
                             const float *xsum, float *y, int64_t K, int64_t group) {
    const int64_t G = num_groups(K, group);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float off0 = 0, off1 = 0;
    for (int64_t g = 0; g < G; g++) {
        __m256 a[4], b[4];
        for (int i = 0; i < 4; i++) { a[i] = _mm256_setzero_ps(); b[i] = _mm256_setzero_ps(); }
        for (int64_t c = g * group; c < group_end(g, K, group); c += 32) {
            __m256 xs[4];
            for (int i = 0; i < 4; i++) xs[i] = _mm256_loadu_ps(x + c + 8 * i);
            for (int r = 0; r < 2; r++) {
                /* DRAM-resident weights: a single stream's hardware prefetch alone leaves ~10% idle */
                _mm_prefetch((const char *)(row + r * (K / 2) + c / 2 + PREFETCH_BYTES), _MM_HINT_T0);
                __m256 w[4], *acc = r ? b : a;
                int4_chunk(row + r * (K / 2) + c / 2, w);
                for (int i = 0; i < 4; i++) acc[i] = _mm256_fmadd_ps(w[i], xs[i], acc[i]);
            }
        }
        __m256 sa = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
        __m256 sb = _mm256_add_ps(_mm256_add_ps(b[0], b[1]), _mm256_add_ps(b[2], b[3]));
        acc0 = _mm256_fmadd_ps(sa, _mm256_set1_ps(scale[g]), acc0);
        acc1 = _mm256_fmadd_ps(sb, _mm256_set1_ps(scale[G + g]), acc1);
        off0 += offset[g] * xsum[g];
        off1 += offset[G + g] * xsum[g];
    }
    y[0] = hsum(acc0) + off0;
    y[1] = hsum(acc1) + off1;
}

static inline void int8_pair(const float *x, const int8_t *row, const float *scale, float *y, int64_t K, int64_t group) {
    const int64_t G = num_groups(K, group);
    if (group == HALF_GROUP) {
        for (int r = 0; r < 2; r++) int8_row_halves(x, row + r * K, scale + r * G, y, r, 1, K, 1);
        return;
    }
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 a[4], b[4];
        for (int i = 0; i < 4; i++) { a[i] = _mm256_setzero_ps(); b[i] = _mm256_setzero_ps(); }
        for (int64_t c = g * group; c < group_end(g, K, group); c += 32) {
            __m256 xs[4];
            for (int i = 0; i < 4; i++) xs[i] = _mm256_loadu_ps(x + c + 8 * i);
            for (int r = 0; r < 2; r++) {
                const int8_t *w = row + r * K + c;
                __m256 *acc = r ? b : a;
                for (int i = 0; i < 4; i++)
                    acc[i] = _mm256_fmadd_ps(sbytes_to_float(_mm_loadl_epi64((const __m128i *)(w + 8 * i))), xs[i], acc[i]);
            }
        }
        __m256 sa = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
        __m256 sb = _mm256_add_ps(_mm256_add_ps(b[0], b[1]), _mm256_add_ps(b[2], b[3]));
        acc0 = _mm256_fmadd_ps(sa, _mm256_set1_ps(scale[g]), acc0);
        acc1 = _mm256_fmadd_ps(sb, _mm256_set1_ps(scale[G + g]), acc1);
    }
    y[0] = hsum(acc0);
    y[1] = hsum(acc1);
}
