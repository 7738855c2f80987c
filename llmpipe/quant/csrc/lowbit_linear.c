/* Fused dequantize-matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T with W held as 4- or 8-bit
 * codes and float32 group scales, accumulated in float32 (AVX2 + FMA, OpenMP over output rows).
 *
 * int4: W[n, k] = code * scale[n, g] + offset[n, g], g = k / group. Codes are packed per 32-element
 *       chunk of a row as 16 bytes: byte j holds element j in its low nibble and j + 16 in its high
 *       one (ggml's Q4 order, so GGUF Q4_0 / Q4_1 bytes are already in this layout).
 * int8: W[n, k] = code * scale[n, g].
 * Requires K % 32 == 0, group % 32 == 0, M <= MAX_ROWS (the caller pads / splits).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_ROWS 8

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 bytes_to_float(__m128i bytes8) { /* low 8 unsigned bytes → 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8));
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
    const int64_t G = K / group;
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 acc[MAX_ROWS];
    float off[MAX_ROWS];
    for (int m = 0; m < MR; m++) { acc[m] = _mm256_setzero_ps(); off[m] = 0; }
    for (int64_t g = 0; g < G; g++) {
        __m256 ga[MAX_ROWS], gb[MAX_ROWS];
        for (int m = 0; m < MR; m++) { ga[m] = _mm256_setzero_ps(); gb[m] = _mm256_setzero_ps(); }
        for (int64_t c = g * group; c < (g + 1) * group; c += 32) {
            __m128i b = _mm_loadu_si128((const __m128i *)(row + c / 2));
            __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
            __m256 w0 = bytes_to_float(lo), w1 = bytes_to_float(_mm_srli_si128(lo, 8));
            __m256 w2 = bytes_to_float(hi), w3 = bytes_to_float(_mm_srli_si128(hi, 8));
            chunk_fma(w0, w1, w2, w3, x + c, K, ga, gb, MR);
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
    const int64_t G = K / group;
    __m256 acc[MAX_ROWS];
    for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 ga[MAX_ROWS], gb[MAX_ROWS];
        for (int m = 0; m < MR; m++) { ga[m] = _mm256_setzero_ps(); gb[m] = _mm256_setzero_ps(); }
        for (int64_t c = g * group; c < (g + 1) * group; c += 32) {
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

#define FOR_ROWS(M, CALL)                                   \
    switch (M) {                                            \
    case 1: CALL(1); break; case 2: CALL(2); break;         \
    case 3: CALL(3); break; case 4: CALL(4); break;         \
    case 5: CALL(5); break; case 6: CALL(6); break;         \
    case 7: CALL(7); break; default: CALL(8); break;        \
    }

void int4_linear(const float *x, const uint8_t *codes, const float *scale, const float *offset, float *y,
                 int64_t M, int64_t N, int64_t K, int64_t group) {
    const int64_t G = K / group;
    float *xsum = malloc(sizeof(float) * M * G); /* the offset term: offset[n, g] * sum of x over group g */
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0;
            for (int64_t k = g * group; k < (g + 1) * group; k++) s += x[m * K + k];
            xsum[m * G + g] = s;
        }
#define INT4_ROWS(MR)                                                                              \
    _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < N; n++)                   \
        int4_row(x, codes + n * (K / 2), scale + n * G, offset + n * G, xsum, y, n, N, K, group, MR)
    FOR_ROWS(M, INT4_ROWS)
    free(xsum);
}

void int8_linear(const float *x, const int8_t *codes, const float *scale, float *y,
                 int64_t M, int64_t N, int64_t K, int64_t group) {
    const int64_t G = K / group;
#define INT8_ROWS(MR)                                                                              \
    _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < N; n++)                   \
        int8_row(x, codes + n * K, scale + n * G, y, n, N, K, group, MR)
    FOR_ROWS(M, INT8_ROWS)
}
