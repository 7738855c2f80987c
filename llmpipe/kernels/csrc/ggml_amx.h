/* Batches of rows (prefill chunks, batched decode) against ggml blocks on AMX tiles (Sapphire Rapids and
 * later), chosen at run time where the CPU has AMX-INT8 and the kernel lets the process use its tiles.
 *
 * The numbers are the row kernels' (ggml_rows.h), exactly: each block of 32 weights (16 for Q6_K, whose
 * scales are per 16) is unpacked once to ggml_unpack's signed codes, made by the row kernels' own vector code
 * producers (amx_unpack_row), and a tile multiply gives, for sixteen
 * weight rows against sixteen activation rows at once, the same integer dot of codes against codes that
 * the row kernels make one lane at a time; the float work, scale * dx * dot - min * xsum, is the same too.
 *
 * Layout: the activations' planes are laid out once per call as the tiles' B operand (per sixteen
 * activation rows and block: 8 rows of 64 bytes, row r holding codes 4r .. 4r + 3 of each of the sixteen
 * rows side by side). The weight is walked GGML_CHUNK weights of each row at a time: that chunk of the
 * activations (512 rows x 1,024 x two planes: 1 MiB) stays in L2 while a thread's weight tiles pass over
 * it; each weight tile's chunk is unpacked once and meets every sixteen activation rows. */
#pragma once
#include <cpuid.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ggml_rows.h"

#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define AMX_ROWS 16 /* a tile's rows: weight rows per weight tile, activation rows per activation tile */
/* Batches of at least this many rows take the tiles; fewer, the VNNI rows are faster (8,192 x 2,048 at 8 rows: Q4_K
 * 1.5 ms against 2.0, Q6_K 2.2 against 2.7; at 6 rows even or slower). */
#define AMX_MIN_ROWS 8

/* Whether the CPU has AMX-INT8 and this process may use its tile data (Linux asks each process to request
 * it: arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA). */
static int use_amx(void) {
    static int cached = -1;
    if (cached < 0) {
        unsigned a, b, c, d;
        int ok = use_vnni() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1);
#ifdef SYS_arch_prctl
        ok = ok && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
        ok = 0;
#endif
        cached = ok;
    }
    return cached;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) AmxConfig;

/* The activations as the tiles read them (amx_pack): T tiles of sixteen rows (the last padded with zeros). */
typedef struct {
    const int8_t *b;  /* [T][K / 32][planes][8][64] */
    const float *dx;  /* [T][K / 32][16] */
    const float *xs;  /* [T][K / 32][16] */
    int64_t M, T, K;
    int planes;
} AmxActs;

static inline int64_t amx_tiles(int64_t M) { return (M + AMX_ROWS - 1) / AMX_ROWS; }
static inline int64_t amx_act_bytes(int64_t M, int64_t K, int planes) { return amx_tiles(M) * AMX_ROWS * K * planes; }
static inline int64_t amx_act_floats(int64_t M, int64_t K) { return amx_tiles(M) * AMX_ROWS * (K / BLOCK); }

/* quantize_rows' planes, dx and xsum (groups of 32) → AmxActs' buffers b, dx, xs, activation tiles [t0, t1). */
static void amx_pack(const int8_t *qx, const float *dx, const float *xsum, int64_t M, int64_t K, int planes, int64_t t0,
                     int64_t t1, int8_t *b, float *dxt, float *xst) {
    const int64_t C = K / BLOCK;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t c = 0; c < C; c++) {
            for (int j = 0; j < AMX_ROWS; j++) {
                const int64_t m = t * AMX_ROWS + j, at = (t * C + c) * AMX_ROWS + j;
                dxt[at] = m < M ? dx[m * C + c] : 0.0f;
                xst[at] = m < M ? xsum[m * C + c] : 0.0f;
                for (int p = 0; p < planes; p++) {
                    int8_t *tile = b + ((t * C + c) * planes + p) * (8 * 64);
                    const int8_t *src = qx + p * M * K + m * K + c * BLOCK;
                    for (int r = 0; r < 8; r++) {
                        if (m < M) memcpy(tile + r * 64 + 4 * j, src + 4 * r, 4);
                        else memset(tile + r * 64 + 4 * j, 0, 4);
                    }
                }
            }
        }
}

#define AMX_M32_STRIDE (GGML_CHUNK / BLOCK)     /* floats of a weight row's mins in amx_unpack's buffers */
#define AMX_S16_STRIDE (2 * GGML_CHUNK / BLOCK) /* and of its scales */

/* Weight row r of a tile (its bytes at `row`), weights [k0, k1), unpacked for the tiles: signed codes u - zero
 * (ggml_unpack's, made here with the row kernels' vector code producers) at codes [block][r][32], scales at
 * s16 [r][sub-block] (one per 32 weights, per 16 for Q6_K), the mins met through xsum at m32 [r][block]: a row's
 * scales side by side, stored a super-block at a time. */
AMX static void amx_unpack_row(int64_t type, const uint8_t *row, int64_t k0, int64_t k1, int64_t r, int64_t ahead,
                               int8_t *codes, float *s16, float *m32) {
    const int zs = ggml_zero_shift(type);
    const __m256i zero = _mm256_set1_epi8(zs < 0 ? 0 : (char)(1 << zs));
    const int64_t c0 = k0 / BLOCK;
#define AMX_PUT(c, v) _mm256_store_si256((__m256i *)(codes + ((c) - c0) * AMX_ROWS * BLOCK + r * BLOCK), _mm256_sub_epi8(v, zero))
#define AMX_PUT2(c, v) (AMX_PUT(c, _mm512_castsi512_si256(v)), AMX_PUT((c) + 1, _mm512_extracti64x4_epi64(v, 1)))
#define AMX_SCALES(c, s, m) (s16[AMX_S16_STRIDE * r + (c) - c0] = (s), m32[AMX_M32_STRIDE * r + (c) - c0] = (m))
#define AMX_ROW32(STRIDE, CODES1, MIN, SCALE1)                                                                   \
    for (int64_t c = c0; c < k1 / BLOCK; c++) {                                                                  \
        const uint8_t *b = row + c * (STRIDE);                                                                   \
        _mm_prefetch((const char *)b + ahead, _MM_HINT_T0);                                                      \
        AMX_PUT(c, CODES1(b));                                                                                   \
        AMX_SCALES(c, SCALE1(b), (MIN) ? -f16_at(b + (MIN)) : 0.0f);                                             \
    }                                                                                                            \
    break;
    switch (type) {
    case GGML_Q4_0: AMX_ROW32(18, Q4_0_CODES1, 0, f16_at)
    case GGML_Q4_1: AMX_ROW32(20, Q4_1_CODES1, 2, f16_at)
    case GGML_Q5_0: AMX_ROW32(22, Q5_0_CODES1, 0, f16_at)
    case GGML_Q5_1: AMX_ROW32(24, Q5_1_CODES1, 2, f16_at)
    case GGML_IQ4_NL: AMX_ROW32(18, IQ4_NL_CODES1, 0, f16_at)
    case GGML_Q8_0: AMX_ROW32(34, Q8_0_CODES1, 0, f16_at)
    case GGML_MXFP4: AMX_ROW32(17, MXFP4_CODES1, 0, e8m0_at)
    case GGML_Q4_K: case GGML_Q5_K: {
        const int q5 = type == GGML_Q5_K;
        for (int64_t sb = k0 / QK_K; sb < k1 / QK_K; sb++) {
            const uint8_t *b = row + sb * (q5 ? 176 : 144);
            PREFETCH_SUPER(b, q5 ? 176 : 144);
            K_SCALES
            _mm256_storeu_ps(s16 + AMX_S16_STRIDE * r + 8 * sb - c0, sc8);
            _mm256_storeu_ps(m32 + AMX_M32_STRIDE * r + 8 * sb - c0, mn8);
            for (int j = 0; j < 4; j++) AMX_PUT2(8 * sb + 2 * j, k_quant_codes(b, q5 ? 48 : 16, q5, j));
        }
        break;
    }
    case GGML_Q6_K:
        for (int64_t sb = k0 / QK_K; sb < k1 / QK_K; sb++) {
            const uint8_t *b = row + sb * 210;
            PREFETCH_SUPER(b, 210);
            for (int h = 0; h < 2; h++) {
                __m512i w0, w1;
                q6_k_codes(b, h, &w0, &w1);
                AMX_PUT2(8 * sb + 4 * h, w0);
                AMX_PUT2(8 * sb + 4 * h + 2, w1);
            }
            const __m512 scales = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))));
            const __m512 d = _mm512_set1_ps(f16_at(b + 208));
            _mm512_storeu_ps(s16 + AMX_S16_STRIDE * r + 2 * (8 * sb - c0), _mm512_mul_ps(d, scales));
            _mm256_storeu_ps(m32 + AMX_M32_STRIDE * r + 8 * sb - c0, _mm256_setzero_ps());
        }
        break;
    default: /* IQ4_XS */
        for (int64_t sb = k0 / QK_K; sb < k1 / QK_K; sb++) {
            const uint8_t *b = row + sb * 136;
            PREFETCH_SUPER(b, 136);
            float sc[8];
            iq4_xs_scales(b, sc);
            for (int j = 0; j < 4; j++) AMX_PUT2(8 * sb + 2 * j, iq4_xs_codes(b, j));
            for (int i = 0; i < 8; i++) AMX_SCALES(8 * sb + i, sc[i], 0.0f);
        }
    }
#undef AMX_ROW32
#undef AMX_SCALES
#undef AMX_PUT2
#undef AMX_PUT
}

/* Weight rows [n, n + rows) (rows <= 16; the rest zero), weights [k0, k1), unpacked for the tiles
 * (amx_unpack_row), prefetching the bytes `ahead` on (the next tile's, unpacked next). */
AMX static void amx_unpack(int64_t type, const uint8_t *blocks, int64_t row_bytes, int64_t n, int64_t rows, int64_t k0,
                           int64_t k1, int64_t ahead, int8_t *codes, float *s16, float *m32) {
    const int64_t nb = (k1 - k0) / BLOCK;
    if (rows < AMX_ROWS) {
        memset(codes, 0, nb * AMX_ROWS * BLOCK);
        memset(s16, 0, sizeof(float) * AMX_S16_STRIDE * AMX_ROWS);
        memset(m32, 0, sizeof(float) * AMX_M32_STRIDE * AMX_ROWS);
    }
    for (int64_t r = 0; r < rows; r++) amx_unpack_row(type, blocks + (n + r) * row_bytes, k0, k1, r, ahead, codes, s16, m32);
}

/* The tiles' part of sub-block s (block s / SB, its part s % SB of G weights; SB = 32 / G, G 32, or 16 for
 * Q6_K whose scales are per 16): weight rows' codes (16 rows of 32 bytes a block) times activation tile t's
 * planes (512 bytes apart), into tiles 3 and 4. */
#define AMX_BLOCK(s) (SB == 2 ? (s) >> 1 : (s)) /* sub-block s's block (SB: 1 or 2, a division without idiv) */
#define AMX_PART(s) (SB == 2 ? (s) & 1 : 0)     /* and its part of it */
#define AMX_ISSUE(s, PL)                                                                                         \
    do {                                                                                                         \
        const int64_t c_ = AMX_BLOCK(s), g_ = AMX_PART(s), at_ = t * C + k0 / BLOCK + c_;                        \
        const int8_t *bt_ = a_->b + at_ * PLANES * 512 + g_ * 256;                                               \
        _tile_loadd(0, codes + c_ * AMX_ROWS * BLOCK + g_ * 16, 32);                                             \
        _tile_loadd(1, bt_, 64);                                                                                 \
        if (PL == 2) _tile_loadd(2, bt_ + 512, 64);                                                              \
        _tile_zero(3);                                                                                           \
        if (PL == 2) _tile_zero(4);                                                                              \
        _tile_dpbssd(3, 0, 1);                                                                                   \
        if (PL == 2) _tile_dpbssd(4, 0, 2);                                                                      \
    } while (0)

/* acc[r] (lane j: activation row j of the tile) += weight row r's part of sub-block s, from its dots stored
 * at hi / lo: scale * dx * (128 * hi + lo), and at a block's last part - min * xsum. */
#define AMX_FLOAT(s, hi, lo, PL)                                                                                 \
    do {                                                                                                         \
        const int64_t c_ = AMX_BLOCK(s), at_ = t * C + k0 / BLOCK + c_;                                         \
        const __m512 dxv = _mm512_loadu_ps(a_->dx + at_ * AMX_ROWS);                                             \
        const float *sc = s16 + (s);                                                                             \
        for (int r = 0; r < AMX_ROWS; r++) {                                                                     \
            __m512i d = _mm512_load_si512((hi) + r * 16);                                                        \
            if (PL == 2) d = _mm512_add_epi32(_mm512_slli_epi32(d, 7), _mm512_load_si512((lo) + r * 16));        \
            const __m512 scale = _mm512_mul_ps(dxv, _mm512_set1_ps(sc[AMX_S16_STRIDE * r]));                     \
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[r]);                                      \
        }                                                                                                        \
        if (mins && AMX_PART(s) == SB - 1) {                                                                     \
            const __m512 xs = _mm512_loadu_ps(a_->xs + at_ * AMX_ROWS);                                          \
            for (int r = 0; r < AMX_ROWS; r++)                                                                   \
                acc[r] = _mm512_fnmadd_ps(xs, _mm512_set1_ps(m32[AMX_M32_STRIDE * r + c_]), acc[r]);             \
        }                                                                                                        \
    } while (0)

/* Sub-blocks [0, n) in a two-stage pipeline: store s's dots, start s + 1's multiplies, then s's float work
 * while the tiles run (a store right after its multiply waited out the multiply's whole latency). */
#define AMX_PIPELINE(n, PL)                                                                                      \
    do {                                                                                                         \
        AMX_ISSUE(0, PL);                                                                                        \
        for (int64_t s = 0; s < (n); s++) {                                                                      \
            int32_t *hi = dots[s & 1][0], *lo = dots[s & 1][1];                                                  \
            _tile_stored(3, hi, 64);                                                                             \
            if (PL == 2) _tile_stored(4, lo, 64);                                                                \
            if (s + 1 < (n)) AMX_ISSUE(s + 1, PL);                                                               \
            AMX_FLOAT(s, hi, lo, PL);                                                                            \
        }                                                                                                        \
    } while (0)

/* A thread's float accumulators for ggml_amx_slice, kept for its next call (a fifth of a 16-row decode step went to
 * page faults of fresh ones). */
static float *amx_accumulators(int64_t floats) { return thread_kept(KEPT_AMX_ACCUMULATORS, sizeof(float) * floats); }

#define AMX_GROUP_FLOATS (64 * 1024) /* a group of weight tiles' accumulators (256 KiB: they stay in L2) */

/* Weight rows [n0, n1) of one type (row n at blocks + n * row_bytes) against every activation row, into
 * y[m * ld + n - n0]: a group of weight tiles at a time, each walked a chunk of K at a time. */
AMX static void ggml_amx_slice(int64_t type, const uint8_t *blocks, int64_t n0, int64_t n1, const AmxActs *a_, float *y,
                               int64_t ld) {
    const int64_t K = a_->K, T = a_->T, C = K / BLOCK, row_bytes = ggml_row_bytes(type, K);
    const int64_t tiles = (n1 - n0 + AMX_ROWS - 1) / AMX_ROWS, chunk_blocks = GGML_CHUNK / BLOCK;
    const int64_t group = T * AMX_ROWS * AMX_ROWS < AMX_GROUP_FLOATS ? AMX_GROUP_FLOATS / (T * AMX_ROWS * AMX_ROWS) : 1;
    const int G = type == GGML_Q6_K ? 16 : 32, SB = BLOCK / G, PLANES = a_->planes;
    const int mins = type == GGML_Q4_1 || type == GGML_Q5_1 || type == GGML_Q4_K || type == GGML_Q5_K;
    AmxConfig cfg = {0};
    cfg.palette = 1;
    cfg.rows[0] = AMX_ROWS, cfg.colsb[0] = (uint16_t)G;                            /* weight codes */
    cfg.rows[1] = cfg.rows[2] = (uint8_t)(G / 4), cfg.colsb[1] = cfg.colsb[2] = 64; /* activation planes */
    cfg.rows[3] = cfg.rows[4] = AMX_ROWS, cfg.colsb[3] = cfg.colsb[4] = 64;         /* int32 dots */
    _tile_loadconfig(&cfg);
    float *accs = amx_accumulators((group < tiles ? group : tiles) * T * AMX_ROWS * AMX_ROWS);
    int8_t *codes = aligned_alloc(64, chunk_blocks * AMX_ROWS * BLOCK);
    float *s16 = malloc(sizeof(float) * AMX_S16_STRIDE * AMX_ROWS), *m32 = malloc(sizeof(float) * AMX_M32_STRIDE * AMX_ROWS);
    int32_t dots[2][2][AMX_ROWS * 16] __attribute__((aligned(64))); /* [stage][plane]: a sub-block's int32 dots */
    for (int64_t g0 = 0; g0 < tiles; g0 += group) {
        const int64_t g1 = g0 + group < tiles ? g0 + group : tiles;
        for (int64_t k0 = 0; k0 < K; k0 += GGML_CHUNK) {
            const int64_t k1 = k0 + GGML_CHUNK < K ? k0 + GGML_CHUNK : K, nb = (k1 - k0) / BLOCK;
            for (int64_t nt = g0; nt < g1; nt++) {
                const int64_t n = n0 + nt * AMX_ROWS, rows = n1 - n < AMX_ROWS ? n1 - n : AMX_ROWS;
                /* the bytes unpacked next: the group's next tile, its first tile's next chunk, or the next group */
                const int64_t next_nt = nt + 1 < g1 ? nt + 1 : k1 < K ? g0 : g1, next_k0 = nt + 1 < g1 ? k0 : k1 < K ? k1 : 0;
                const int64_t ahead =
                    (next_nt - nt) * AMX_ROWS * row_bytes + ggml_row_bytes(type, next_k0) - ggml_row_bytes(type, k0);
                amx_unpack(type, blocks, row_bytes, n, rows, k0, k1, ahead, codes, s16, m32);
                for (int64_t t = 0; t < T; t++) {
                    float *out = accs + ((nt - g0) * T + t) * AMX_ROWS * AMX_ROWS;
                    __m512 acc[AMX_ROWS];
                    for (int r = 0; r < AMX_ROWS; r++) acc[r] = k0 ? _mm512_load_ps(out + r * AMX_ROWS) : _mm512_setzero_ps();
                    WITH_PLANES(PLANES, AMX_PIPELINE(nb * SB, PL););
                    for (int r = 0; r < AMX_ROWS; r++) _mm512_store_ps(out + r * AMX_ROWS, acc[r]);
                }
            }
        }
        for (int64_t nt = g0; nt < g1; nt++)
            for (int64_t t = 0; t < T; t++) {
                const float *out = accs + ((nt - g0) * T + t) * AMX_ROWS * AMX_ROWS;
                for (int64_t r = 0; r < AMX_ROWS && nt * AMX_ROWS + r < n1 - n0; r++)
                    for (int64_t j = 0; j < AMX_ROWS && t * AMX_ROWS + j < a_->M; j++)
                        y[(t * AMX_ROWS + j) * ld + nt * AMX_ROWS + r] = out[r * AMX_ROWS + j];
            }
    }
    _tile_release();
    free(codes), free(s16), free(m32);
}

/* Whether any of the n segments of a ggml_segment_rows table reads the activations' codes (quantize_rows' planes,
 * their AMX or VNNI layouts) at M rows: none does where every one meets the float activations (ggml_floats_pay). */
static inline int ggml_segments_read_codes(const int64_t *table, int64_t n, int64_t M, int planes, int vnni) {
    for (int64_t i = 0; i < n; i++)
        if (!ggml_floats_pay(vnni, table[3 * i], M, planes)) return 1;
    return 0;
}

/* Rows [n0, n1) of a weight in `n` segments (table: ggml type, rows, address per segment) against every
 * activation row, into y[m * ld + n - n0]: on the tiles where given (`tiles`), else the row kernels (`vnni`: the
 * CPU has AVX512-VNNI). */
static void ggml_segment_rows(const int64_t *table, int64_t n, int64_t n0, int64_t n1, const GGMLActs *a,
                              const AmxActs *tiles, int64_t M, int vnni, float *y, int64_t ld) {
    GGMLActs acts = *a;
    float *sums16 = NULL; /* made once, at the first segment whose rows read them (a stacked layer's, experts') */
    int64_t row0 = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t type = table[3 * i], rows = table[3 * i + 1];
        const int64_t lo = n0 > row0 ? n0 : row0, hi = n1 < row0 + rows ? n1 : row0 + rows;
        const uint8_t *blocks = (const uint8_t *)(uintptr_t)table[3 * i + 2];
        if (lo < hi && tiles && ggml_wide_isas(type)) {
            ggml_amx_slice(type, blocks, lo - row0, hi - row0, tiles, y + (lo - n0), ld);
        } else if (lo < hi) {
            if (!acts.xsum16 && ggml_slice_reads_sums16(vnni, type, M, a->planes)) sums16 = with_sums16(&acts, M);
            ggml_slice(vnni, type, blocks, lo - row0, hi - row0, &acts, M, y + (lo - n0), ld);
        }
        row0 += rows;
    }
    free(sums16);
}
