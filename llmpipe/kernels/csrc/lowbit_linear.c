/* Fused dequantize-matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T with W held as 4- or 8-bit
 * codes and float32 group scales, accumulated in float32 (AVX2 + FMA, OpenMP over output rows).
 *
 * int4: W[n, k] = code * scale[n, g] + offset[n, g], g = k / group. Codes are packed per 32-element
 *       chunk of a row as 16 bytes: byte j holds element j in its low nibble and j + 16 in its high
 *       one (ggml's Q4 order, so GGUF Q4_0 / Q4_1 bytes are already in this layout).
 * int8: W[n, k] = code * scale[n, g].
 * Requires K % 32 == 0, group % 32 == 0, M <= MAX_ROWS (the caller pads / splits). The last group
 * may be narrower than `group` (SmolLM2's K = 576 at group 128): ceil(K / group) groups per row.
 * A single activation row (batch-1 decode) takes two output rows at a time with four accumulators
 * each: eight independent FMA chains, where one row's two would wait on FMA latency.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define MAX_ROWS 8
#define PREFETCH_BYTES 4096

static inline int64_t num_groups(int64_t K, int64_t group) { return (K + group - 1) / group; }
static inline int64_t group_end(int64_t g, int64_t K, int64_t group) { return (g + 1) * group < K ? (g + 1) * group : K; }

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

static inline __attribute__((always_inline)) void int8_row(
    const float *x, const int8_t *row, const float *scale, float *y, int64_t n, int64_t N, int64_t K,
    int64_t group, const int MR) {
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
