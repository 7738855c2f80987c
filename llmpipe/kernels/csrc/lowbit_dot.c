/* Low-bit matmul with integer dot products, as llama.cpp's CPU backend does it: the activation row is
 * quantized once per call in blocks of 32 (one float scale per block, round to nearest even) — to int8
 * (|q| <= 127), or to 15-bit codes held as two int8 planes (lowbit_q8_rows.h: quantize_rows), whose
 * rounding error is 128x smaller, near the float path's — then each 32-weight chunk's dot product is
 * one run of integer multiply-adds per plane:
 *   AVX2:        _mm256_maddubs_epi16 + _mm256_madd_epi16 (unsigned codes x signed activations)
 *   AVX512-VNNI: _mm512_dpbusd_epi32, two chunks a step (chosen at run time, where the CPU has it)
 * Weights are the same buffers the float kernel (lowbit_linear.c) reads: INT4 codes two a byte per
 * 32-element chunk (byte j: element j low nibble, j + 16 high), a scale and an offset per group; INT8
 * codes with a scale per group. For INT4 the offset term meets the sum of the quantized x over the group.
 *
 * y[m, n] = sum_g scale[n, g] * sum_{c in g} dx[m, c] * <w[n, c], qx[m, c]>
 *           (+ offset[n, g] * sum_{c in g} dx[m, c] * sum(qx[m, c]))
 *
 * Requires K % 32 == 0 and group % 32 == 0; the last group may be narrower than `group`.
 * M activation rows (decode batch) share each weight read.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "lowbit_q5_rows.h"
#include "lowbit_q8_rows.h"

/* ---- entry points ------------------------------------------------------------------------------ */

int has_vnni(void) { return use_vnni(); }

/* The loop over output rows, once per ISA (so each row function inlines with its rows unrolled).
 * OFFSET is INT4's offset row (NULL for INT8); PL the planes (WITH_PLANES). */
#define ROWS(ROW, MR, ROW_BYTES, OFFSET)                                                                \
    _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < N; n++) {                      \
        float out[8];                                                                                   \
        ROW(codes + n * (ROW_BYTES), scale + n * G, qx, dx, K, group, cg, out, MR, OFFSET, xsum, M * K, PL); \
        for (int m = 0; m < MR; m++) y[m * N + n] = out[m];                                             \
    }
#define INT4_ROWS(ROW) INT4_ROWS_##ROW
#define INT4_ROWS_int4_row_avx2(MR) ROWS(int4_row_avx2, MR, K / 2, offset + n * G)
#define INT4_ROWS_int4_row_vnni(MR) ROWS(int4_row_vnni, MR, K / 2, offset + n * G)
#define INT8_ROWS(ROW) INT8_ROWS_##ROW
#define INT8_ROWS_int8_row_avx2(MR) ROWS(int8_row_avx2, MR, K, NULL)
#define INT8_ROWS_int8_row_vnni(MR) ROWS(int8_row_vnni, MR, K, NULL)

#define DEFINE_INT4_LINEAR(NAME, ATTR, ROW)                                                             \
    ATTR static void NAME(const int8_t *qx, const float *dx, const float *xsum, const uint8_t *codes,   \
                          const float *scale, const float *offset, float *y, int64_t M, int64_t N,      \
                          int64_t K, int64_t group, const int32_t *cg, int planes) {                    \
        const int64_t G = num_groups(K, group);                                                         \
        WITH_PLANES(planes, FOR_ROWS(M, INT4_ROWS(ROW)));                                               \
    }
#define DEFINE_INT8_LINEAR(NAME, ATTR, ROW)                                                             \
    ATTR static void NAME(const int8_t *qx, const float *dx, const float *xsum, const int8_t *codes,    \
                          const float *scale, const float *offset, float *y, int64_t M, int64_t N,      \
                          int64_t K, int64_t group, const int32_t *cg, int planes) {                    \
        const int64_t G = num_groups(K, group);                                                         \
        (void)offset;                                                                                   \
        WITH_PLANES(planes, FOR_ROWS(M, INT8_ROWS(ROW)));                                               \
    }

/* One activation row: STEP weight rows at a time, each thread a run of whole fours. */
#define DEFINE_M1_LINEAR(NAME, ATTR, WEIGHT_T, ROWS, STEP, ROW_BYTES)                                         \
    ATTR static void NAME(const int8_t *qx, const float *dx, const float *xsum, const WEIGHT_T *codes,  \
                          const float *scale, const float *offset, float *y, int64_t N, int64_t K,      \
                          int64_t group, const int32_t *cg, int planes) {                               \
        const int64_t G = num_groups(K, group);                                                         \
        _Pragma("omp parallel") {                                                                       \
            int64_t n0, n1;                                                                             \
            thread_rows(N, 4, &n0, &n1);                                                                \
            WITH_PLANES(planes, M1_LOOP(ROWS, STEP, codes, ROW_BYTES, scale, offset, G, (y + n0)););     \
        }                                                                                               \
    }
#define NO_ATTR
DEFINE_M1_LINEAR(int4_dot_avx2_m1, NO_ATTR, uint8_t, int4_rows_avx2_m1, AVX2_INT4_STEP, K / 2)
DEFINE_M1_LINEAR(int8_dot_avx2_m1, NO_ATTR, int8_t, int8_rows_avx2_m1, AVX2_INT8_STEP, K)
DEFINE_M1_LINEAR(int4_dot_vnni_m1, VNNI, uint8_t, int4_rows_vnni_m1, VNNI_INT4_STEP, K / 2)
DEFINE_M1_LINEAR(int8_dot_vnni_m1, VNNI, int8_t, int8_rows_vnni_m1, VNNI_INT8_STEP, K)

DEFINE_INT4_LINEAR(int4_dot_avx2, NO_ATTR, int4_row_avx2)
DEFINE_INT4_LINEAR(int4_dot_vnni, VNNI, int4_row_vnni)
DEFINE_INT8_LINEAR(int8_dot_avx2, NO_ATTR, int8_row_avx2)
DEFINE_INT8_LINEAR(int8_dot_vnni, VNNI, int8_row_vnni)

/* Q5_0 blocks (lowbit_q5_rows.h): each thread unpacks its rows one at a time and runs the INT8 row
 * functions on them, as the INT8 entry points do on codes in place (batch 1: the one-row function; on
 * VNNI the rows straight from their blocks). */
#define Q5_0_M1_avx2                                                                                    \
    unpack_q5_0_rows(blocks + n * q5_0_row_bytes(K), 1, K, codes, scale);                               \
    int8_rows_avx2_m1(codes, K, scale, qx, dx, K, 32, cg, y + n, 1, NULL, xsum, K, PL);
#define Q5_0_M1_vnni y[n] = q5_0_row_vnni_m1(blocks + n * q5_0_row_bytes(K), qx, dx, bias, K, K, PL);
#define Q5_0_BIAS_avx2
#define Q5_0_BIAS_vnni q5_0_bias(qx, K, K, PL, bias);
#define Q5_0_ROW(ROW, MR)                                                                               \
    {                                                                                                   \
        float out[8];                                                                                   \
        ROW(codes, scale, qx, dx, K, 32, cg, out, MR, NULL, xsum, M * K, PL);                           \
        for (int m = 0; m < MR; m++) y[m * N + n] = out[m];                                             \
    }
#define Q5_0_ROW_avx2(MR) Q5_0_ROW(int8_row_avx2, MR)
#define Q5_0_ROW_vnni(MR) Q5_0_ROW(int8_row_vnni, MR)
#define DEFINE_Q5_0_LINEAR(NAME, ATTR, ISA)                                                             \
    ATTR static void NAME(const int8_t *qx, const float *dx, const float *xsum, const uint8_t *blocks,  \
                          float *y, int64_t M, int64_t N, int64_t K, const int32_t *cg, int planes) {   \
        _Pragma("omp parallel") {                                                                       \
            int8_t *codes = malloc(K);                                                                  \
            float *scale = malloc(sizeof(float) * (K / 32));                                            \
            int32_t *bias = malloc(sizeof(int32_t) * 2 * (K / 4));                                      \
            int64_t n0, n1;                                                                             \
            thread_rows(N, 4, &n0, &n1);                                                                \
            WITH_PLANES(planes, if (M == 1) {                                                           \
                Q5_0_BIAS_##ISA for (int64_t n = n0; n < n1; n++) { Q5_0_M1_##ISA }                     \
            } else for (int64_t n = n0; n < n1; n++) {                                                  \
                unpack_q5_0_rows(blocks + n * q5_0_row_bytes(K), 1, K, codes, scale);                   \
                FOR_ROWS(M, Q5_0_ROW_##ISA)                                                             \
            });                                                                                         \
            free(codes), free(scale), free(bias);                                                       \
        }                                                                                               \
    }
DEFINE_Q5_0_LINEAR(q5_0_dot_avx2, NO_ATTR, avx2)
DEFINE_Q5_0_LINEAR(q5_0_dot_vnni, VNNI, vnni)

enum { DOT_INT8 = 0, DOT_INT4 = 1, DOT_Q5_0 = 2 };

/* y[M <= 8, N] = x[M, K] @ W^T with x quantized here (quantize_rows) to `bits` 8 (one plane) or 16 (two
 * planes, 15-bit codes); `isa`: 0 AVX2, 1 VNNI where the CPU has it. The weights (`kind`): codes [N, K / 2]
 * (INT4, with `offset`), codes [N, K] (INT8, offset NULL), scale [N, G]; or Q5_0 blocks [N, K / 32 * 22]
 * (scale and offset NULL, group 32). */
static void linear_dot(int kind, const float *x, const void *codes, const float *scale, const float *offset,
                       float *y, int64_t M, int64_t N, int64_t K, int64_t group, int64_t bits, int64_t isa) {
    const int planes = bits == 16 ? 2 : 1, vnni = isa && use_vnni();
    int8_t *qx = malloc(activation_bytes(M, K, planes));
    float *dx = malloc(sizeof(float) * M * (K / BLOCK)), *xsum = malloc(sizeof(float) * M * num_groups(K, group));
    int32_t *cg = chunk_groups(K, group);
    quantize_rows(x, M, K, group, planes, qx, dx, xsum);
    if (kind == DOT_Q5_0)
        (vnni ? q5_0_dot_vnni : q5_0_dot_avx2)(qx, dx, xsum, codes, y, M, N, K, cg, planes);
    else if (M == 1 && kind == DOT_INT4) {
        int8_t *ordered = malloc(activation_bytes(M, K, planes));
        int4_m1_order(qx, K, planes, vnni, ordered);
        (vnni ? int4_dot_vnni_m1 : int4_dot_avx2_m1)(ordered, dx, xsum, codes, scale, offset, y, N, K, group, cg, planes);
        free(ordered);
    } else if (M == 1)
        (vnni ? int8_dot_vnni_m1 : int8_dot_avx2_m1)(qx, dx, xsum, codes, scale, NULL, y, N, K, group, cg, planes);
    else if (kind == DOT_INT4)
        (vnni ? int4_dot_vnni : int4_dot_avx2)(qx, dx, xsum, codes, scale, offset, y, M, N, K, group, cg, planes);
    else
        (vnni ? int8_dot_vnni : int8_dot_avx2)(qx, dx, xsum, codes, scale, NULL, y, M, N, K, group, cg, planes);
    free(qx), free(dx), free(xsum), free(cg);
}

/* As int8_linear_dot, for a weight held as Q5_0 blocks [N, K / 32 * 22]. */
void q5_0_linear_dot(const float *x, const uint8_t *blocks, float *y, int64_t M, int64_t N, int64_t K, int64_t bits,
                     int64_t isa) {
    linear_dot(DOT_Q5_0, x, blocks, NULL, NULL, y, M, N, K, BLOCK, bits, isa);
}

void int4_linear_dot(const float *x, const uint8_t *codes, const float *scale, const float *offset, float *y,
                     int64_t M, int64_t N, int64_t K, int64_t group, int64_t bits, int64_t isa) {
    linear_dot(DOT_INT4, x, codes, scale, offset, y, M, N, K, group, bits, isa);
}

void int8_linear_dot(const float *x, const int8_t *codes, const float *scale, float *y,
                     int64_t M, int64_t N, int64_t K, int64_t group, int64_t bits, int64_t isa) {
    linear_dot(DOT_INT8, x, codes, scale, NULL, y, M, N, K, group, bits, isa);
}
