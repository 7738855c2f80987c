/* panel_tile and panel_rows for one instruction set, included by lowbit_panels.h once per ISA (ISA its
 * name, ISA_ATTR its target attribute): the tiles are the same, the block dots ISA's own. */
#define ISA_FN(name) ISA_CAT(name, ISA)

/* INT4 block: the dot of each of MR rows' PL planes (`plane_bytes` apart: of two, the high one first)
 * with the panel's 8 rows, as 8 int32 lanes. Each quad's codes are unpacked once for every row and
 * plane, and every row and plane sums on its own (dpbusd's latency: one chain a row left half its
 * throughput idle). */
ISA_ATTR static inline __attribute__((always_inline)) void ISA_FN(int4_block_dots)(const uint8_t *block, const int8_t *x,
                                                                            int64_t row_bytes, int64_t plane_bytes,
                                                                            __m256i dots[], const int MR, const int PL) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i sums[2][GEMM_ROWS];
    for (int pl = 0; pl < PL; pl++)
        for (int r = 0; r < MR; r++) sums[pl][r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
        const __m256i first = _mm256_and_si256(v, nibble), second = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < MR; r++)
            for (int pl = 0; pl < PL; pl++)
                sums[pl][r] = ISA_FN(int4_quad_sum)(sums[pl][r], first, second, x + pl * plane_bytes + r * row_bytes + 4 * j);
    }
    for (int r = 0; r < MR; r++)
        dots[r] = PL == 1 ? ISA_FN(int4_plane_dots)(sums[0][r], 0)
                          : _mm256_add_epi32(ISA_FN(int4_plane_dots)(sums[0][r], 1), ISA_FN(int4_plane_dots)(sums[1][r], 0));
}

/* INT8 block, per half (inputs 0-15: dots[r][0], 16-31: dots[r][1]). Signed codes: the high plane
 * (signed) takes llama.cpp's sign trick, |w| times x carrying w's sign; the low plane (0..127) meets
 * the codes directly. `high`: the high plane of two, its dots times 128. */
ISA_ATTR static inline __attribute__((always_inline)) void ISA_FN(int8_block_dots)(const uint8_t *block, const int8_t *x,
                                                                            int64_t row_bytes, int high, int low_plane,
                                                                            __m256i dots[][2], const int MR) {
    for (int r = 0; r < MR; r++) dots[r][0] = dots[r][1] = _mm256_setzero_si256();
    for (int q = 0; q < 8; q++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(block + 32 * q)), wabs = _mm256_sign_epi8(w, w);
        for (int r = 0; r < MR; r++) {
            const __m256i xq = quad_copies(x + r * row_bytes + 4 * q);
            dots[r][q / 4] = low_plane ? ISA_FN(byte_dot)(dots[r][q / 4], xq, w)
                                       : ISA_FN(byte_dot)(dots[r][q / 4], wabs, _mm256_sign_epi8(xq, w));
        }
    }
    if (high)
        for (int r = 0; r < MR; r++) dots[r][0] = _mm256_slli_epi32(dots[r][0], 7), dots[r][1] = _mm256_slli_epi32(dots[r][1], 7);
}

#if WIDE_INT8
/* INT8 block against MR rows of int16 codes (K apart), per half: each quad's codes widened, low 16
 * bytes (rows 0-3) and high (rows 4-7), meet the quad's 4 activations copied 4 times; each int32 lane
 * gathers two inputs of one row (|sum| <= 8 * 16,256 * 128 over a half), added pairwise at the end. */
ISA_ATTR static inline __attribute__((always_inline)) void ISA_FN(int8_block_dots_wide)(const uint8_t *block, const int16_t *x, int64_t K,
                                                                       __m256i dots[][2], const int MR) {
    for (int h = 0; h < 2; h++) {
        __m256i lo[GEMM_ROWS], hi[GEMM_ROWS];
        for (int r = 0; r < MR; r++) lo[r] = hi[r] = _mm256_setzero_si256();
        for (int q = 4 * h; q < 4 * h + 4; q++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(block + 32 * q));
            const __m256i wl = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)), wh = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
            for (int r = 0; r < MR; r++) {
                const __m256i xq = _mm256_set1_epi64x(*(const int64_t *)(x + r * K + 4 * q));
                lo[r] = ISA_FN(wide_dot)(lo[r], wl, xq);
                hi[r] = ISA_FN(wide_dot)(hi[r], wh, xq);
            }
        }
        for (int r = 0; r < MR; r++) /* lanes (0 1 4 5 | 2 3 6 7) after the pairwise add: back to row order */
            dots[r][h] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(lo[r], hi[r]), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
    }
}
#endif

/* One tile: MR activation rows against one panel, all K / 32 blocks; out[MR][PANEL]. qx: the tile as
 * pack_tiles lays it out (its int16 rows, K apart, for WIDE_INT8's INT8 x 16-bit blocks); dx, xsum:
 * the rows' block scales and block sums (sums of the quantized x, INT4's offset term), K / 32 apart. */
ISA_ATTR static inline __attribute__((always_inline)) void ISA_FN(panel_tile)(const int kind, const uint8_t *panel, const int8_t *qx,
                                                             const float *dx, const float *xsum, int64_t K,
                                                             float out[][PANEL], const int MR, const int PL) {
    const int64_t B = K / BLOCK, block_bytes = kind == PANEL_INT4 ? INT4_PANEL_BYTES : INT8_PANEL_BYTES;
    const int64_t code_bytes = kind == PANEL_INT4 ? 128 : 256;
    __m256 acc[GEMM_ROWS];
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *block = panel + b * block_bytes;
        const float *scales = (const float *)(block + code_bytes);
        const int8_t *x = qx + b * MR * PL * BLOCK; /* row r's plane pl at x + (r * PL + pl) * BLOCK */
        __m256i dots[GEMM_ROWS][2];
        if (kind == PANEL_INT4) {
            __m256i whole[GEMM_ROWS];
            ISA_FN(int4_block_dots)(block, x, PL * BLOCK, BLOCK, whole, MR, PL);
            for (int r = 0; r < MR; r++) dots[r][0] = whole[r];
        }
#if WIDE_INT8
        else if (PL == 2)
            ISA_FN(int8_block_dots_wide)(block, (const int16_t *)qx + b * BLOCK, K, dots, MR);
#endif
        else
            for (int pl = 0; pl < PL; pl++) { /* the high (or only) plane, then the low one */
                __m256i d[GEMM_ROWS][2];
                ISA_FN(int8_block_dots)(block, x + pl * BLOCK, PL * BLOCK, PL == 2 && pl == 0, pl == 1, d, MR);
                for (int r = 0; r < MR; r++)
                    for (int h = 0; h < 2; h++) dots[r][h] = pl == 0 ? d[r][h] : _mm256_add_epi32(dots[r][h], d[r][h]);
            }
        for (int r = 0; r < MR; r++) {
            const __m256 d = _mm256_set1_ps(dx[r * B + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r][0]), _mm256_mul_ps(_mm256_loadu_ps(scales), d), acc[r]);
            if (kind == PANEL_INT4)
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(scales + PANEL), _mm256_set1_ps(xsum[r * B + b]), acc[r]);
            else
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r][1]), _mm256_mul_ps(_mm256_loadu_ps(scales + PANEL), d), acc[r]);
        }
    }
    for (int r = 0; r < MR; r++) _mm256_storeu_ps(out[r], acc[r]);
}

#define PANEL_TILE(MR)                                                                                  \
    do {                                                                                                \
        ISA_FN(panel_tile)(kind, panel, qx + m0 * PL * K, dx + m0 * B, xsum + m0 * B, K, out, MR, PL);              \
        for (int r = 0; r < MR; r++) memcpy(y + (m0 + r) * ld + col, out[r], sizeof(float) * cols);     \
    } while (0)

/* Every row of M against panels [p0, p1): output n (< N) landing in y[m * ld + n - n0]. qx: the rows
 * as panel_tile takes them, tile by tile (GEMM_ROWS rows, PL * K bytes each). */
ISA_ATTR static inline __attribute__((always_inline)) void ISA_FN(panel_tiles)(
    const int kind, const uint8_t *panels, int64_t p0, int64_t p1, const int8_t *qx, const float *dx,
    const float *xsum, int64_t M, int64_t N, int64_t K, float *y, int64_t ld,
    int64_t n0, const int PL) {
    const int64_t B = K / BLOCK, block_bytes = kind == PANEL_INT4 ? INT4_PANEL_BYTES : INT8_PANEL_BYTES;
    for (int64_t p = p0; p < p1; p++) {
        float out[GEMM_ROWS][PANEL];
        const uint8_t *panel = panels + p * B * block_bytes;
        const int64_t col = p * PANEL - n0, cols = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
        int64_t m0 = 0;
        for (; m0 + GEMM_ROWS <= M; m0 += GEMM_ROWS) PANEL_TILE(GEMM_ROWS);
        switch (M - m0) {
        case 1: PANEL_TILE(1); break;
        case 2: PANEL_TILE(2); break;
        case 3: PANEL_TILE(3); break;
        }
    }
}


/* panel_tiles with the kind and plane count as constants, each combination its own loops; a function of
 * its own, so its ISA's code is entered through one call. */
ISA_ATTR static void ISA_FN(panel_rows)(int kind, int planes, const uint8_t *panels, int64_t p0, int64_t p1,
                                        const int8_t *qx, const float *dx, const float *xsum, int64_t M, int64_t N,
                                        int64_t K, float *y, int64_t ld, int64_t n0) {
    WITH_PANEL_KIND(kind, WITH_PLANES(planes, ISA_FN(panel_tiles)(KIND, panels, p0, p1, qx, dx,
                                                                  xsum, M, N, K, y, ld, n0, PL);););
}

#undef PANEL_TILE
#undef ISA_FN
