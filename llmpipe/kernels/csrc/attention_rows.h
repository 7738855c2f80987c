/* Decode attention's pieces (layout: paged_attention.c), shared by paged_attention.c and decode_step.c
 * (which also reads and writes int8 caches: KVRows, quantize_kv_row). */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* e^x for x <= 0 (softmax after subtracting the maximum), 8 lanes: Cephes' expf polynomial (within ~2 ulp
 * of libm's expf), inputs below -87.3 clamped to it (e^-87.3 ~ 1e-38: zero next to the maximum's 1). */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* x - n ln 2, in two parts */
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(two_n));
}

/* p[0..L) = e^(p - top) in place, top = max p (-inf where L = 0) into *top_out; returns their sum. */
static inline float exp_in_place(float *p, int64_t L, float *top_out) {
    float top = -INFINITY, total = 0;
    int64_t t = 0;
    if (L >= 8) { /* NaN scores are passed over, as below (max_ps returns its second operand then) */
        __m256 tops = _mm256_set1_ps(-INFINITY);
        for (; t + 8 <= L; t += 8) tops = _mm256_max_ps(_mm256_loadu_ps(p + t), tops);
        float lanes[8];
        _mm256_storeu_ps(lanes, tops);
        for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    }
    for (; t < L; t++) top = p[t] > top ? p[t] : top;
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sums = _mm256_setzero_ps();
    for (t = 0; t + 8 <= L; t += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + t), shift));
        _mm256_storeu_ps(p + t, e);
        sums = _mm256_add_ps(sums, e);
    }
    if (t < L) { /* the last few, through a zero-padded lane set (exp of the padding is dropped) */
        float rest[8] = {0};
        memcpy(rest, p + t, sizeof(float) * (L - t));
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(rest), shift));
        _mm256_storeu_ps(rest, e);
        for (int64_t i = 0; i < L - t; i++) total += (p[t + i] = rest[i]);
    }
    *top_out = top;
    return total + hsum(sums);
}

/* p[0..L) = softmax(p[0..L)) in place. */
static inline void softmax_in_place(float *p, int64_t L) {
    float top;
    const float inv = 1.0f / exp_in_place(p, L, &top);
    for (int64_t t = 0; t < L; t++) p[t] *= inv;
}

/* One KV head's keys (or values) in a paged cache, read in place: float32 rows, or int8 codes with a
 * float16 scale per position and KV head (quant/kv.py's int8 cache) — a key's dot product is of its
 * codes, times its scale; a value's weight is multiplied by its scale. */
typedef struct {
    const void *rows;         /* the head's first element: float, or int8 codes */
    const uint16_t *scales;   /* int8: the head's first scale (NULL: float32 rows) */
    const int64_t *table;     /* the sequence's block table */
    int64_t block_size, token_stride, block_stride; /* elements between positions / blocks */
    int64_t scale_stride;     /* scales between positions (KVH) */
} KVRows;

/* KV head kvh's keys and values for one sequence (block table `table`) in a cache [2, num_blocks,
 * block_size, KVH, D]: float32, or int8 codes with `scales` [2, num_blocks, block_size, KVH] (NULL: float32). */
static inline void kv_head_rows(const void *cache, const uint16_t *scales, int64_t kvh, int64_t KVH, int64_t D,
                                const int64_t *table, int64_t block_size, int64_t num_blocks, KVRows *k, KVRows *v) {
    const int64_t token_stride = KVH * D, block_stride = block_size * token_stride, half = num_blocks * block_stride;
    const char *base = cache;
    const int64_t element = scales ? 1 : sizeof(float);
    *k = (KVRows){base + kvh * D * element, scales ? scales + kvh : NULL, table, block_size, token_stride, block_stride,
                  KVH};
    *v = *k;
    v->rows = base + (half + kvh * D) * element;
    v->scales = scales ? scales + half / D + kvh : NULL;
}

/* The element offset of position in_block of block `block`, and (int8) its scale. */
static inline int64_t kv_at(const KVRows *src, int64_t block, int64_t in_block) {
    return block * src->block_stride + in_block * src->token_stride;
}
static inline const uint16_t *kv_scales_at(const KVRows *src, int64_t block, int64_t in_block) {
    return src->scales + (block * src->block_size + in_block) * src->scale_stride;
}

/* x (D floats) as the int8 cache stores a position of one KV head: scale = max|x| / 127 in float16,
 * codes round(x / scale) clamped to ±127 — quant/kv.py's quantize, operation for operation. */
static inline void quantize_kv_row(const float *x, int64_t D, int8_t *codes, uint16_t *scale) {
    float top = 0;
    for (int64_t d = 0; d < D; d++) top = fabsf(x[d]) > top ? fabsf(x[d]) : top;
    const float wanted = top / 127.0f;
    *scale = _cvtss_sh(wanted > 1e-8f ? wanted : 1e-8f, _MM_FROUND_TO_NEAREST_INT);
    const float s = _cvtsh_ss(*scale);
    for (int64_t d = 0; d < D; d++) {
        const float q = s > 0 ? nearbyintf(x[d] / s) : 0.0f; /* rounds half to even, as torch.round */
        codes[d] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
    }
}

/* Eight elements of a key row from d on: float32, or int8 codes as floats (CODES a literal). */
static inline __attribute__((always_inline)) __m256 key_strip(const void *row, const int CODES, int64_t d) {
    if (CODES)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + d))));
    return _mm256_loadu_ps((const float *)row + d);
}

/* sums[h][j] = q_h ⊙ k summed over D's 8-lane strips (eight lanes, not yet added up) for HEADS (1..4, a
 * literal) heads, the key row read once for all of them: two FMA chains a head (even and odd strips). */
static inline __attribute__((always_inline)) void key_dots(const float *q, const void *k, const int CODES,
                                                           const int HEADS, int64_t D, __m256 (*sums)[8], int64_t j) {
    __m256 even[4], odd[4];
    for (int h = 0; h < HEADS; h++) even[h] = odd[h] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        const __m256 k0 = key_strip(k, CODES, d), k1 = key_strip(k, CODES, d + 8);
        for (int h = 0; h < HEADS; h++) {
            even[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), k0, even[h]);
            odd[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d + 8), k1, odd[h]);
        }
    }
    if (d < D) {
        const __m256 k0 = key_strip(k, CODES, d);
        for (int h = 0; h < HEADS; h++) even[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), k0, even[h]);
    }
    for (int h = 0; h < HEADS; h++) sums[h][j] = _mm256_add_ps(even[h], odd[h]);
}

/* Lane j = the sum of v[j]'s eight floats: eight horizontal sums in seven adds' worth of shuffles. */
static inline __m256 hsum8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d); /* [v0..v3 low halves | high halves] */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* p[h * L + j] = scale * <q_h, k_j> (int8: times k_j's scale) for one KV head's `group` query heads and
 * the `count` positions of block `block` from `in_block` on, eight positions' sums added up together. */
static void run_scores(const float *q, const KVRows *keys, int64_t block, int64_t in_block, int64_t count,
                       int64_t group, int64_t D, float scale, float *p, int64_t L) {
    const int64_t at = kv_at(keys, block, in_block), stride = keys->token_stride;
    for (int64_t j0 = 0; j0 < count; j0 += 8) {
        const int64_t n = count - j0 < 8 ? count - j0 : 8;
        __m256 weight = _mm256_set1_ps(scale);
        if (keys->scales) {
            const uint16_t *s = kv_scales_at(keys, block, in_block + j0);
            uint16_t halves[8] = {0};
            for (int64_t j = 0; j < n; j++) halves[j] = s[j * keys->scale_stride];
            weight = _mm256_mul_ps(weight, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)halves)));
        }
        for (int64_t h0 = 0; h0 < group; h0 += 4) {
            const int64_t heads = group - h0 < 4 ? group - h0 : 4;
            __m256 sums[4][8];
            const float *qh = q + h0 * D;
#define KEY_DOTS(CODES, HEADS)                                                                                  \
    for (int64_t j = 0; j < n; j++) {                                                                           \
        const int64_t row = at + (j0 + j) * stride;                                                             \
        key_dots(qh, CODES ? (const void *)((const int8_t *)keys->rows + row)                                   \
                           : (const void *)((const float *)keys->rows + row), CODES, HEADS, D, sums, j);        \
    }
#define HEADS_DOTS(CODES) \
    switch (heads) { case 1: KEY_DOTS(CODES, 1) break; case 2: KEY_DOTS(CODES, 2) break; \
                     case 3: KEY_DOTS(CODES, 3) break; default: KEY_DOTS(CODES, 4) break; }
            if (keys->scales)
                HEADS_DOTS(1)
            else
                HEADS_DOTS(0)
#undef HEADS_DOTS
#undef KEY_DOTS
            for (int64_t h = 0; h < heads; h++) {
                for (int64_t j = n; j < 8; j++) sums[h][j] = _mm256_setzero_ps();
                const __m256 s = _mm256_mul_ps(hsum8(sums[h]), weight);
                float *out = p + (h0 + h) * L + j0;
                if (n == 8) {
                    _mm256_storeu_ps(out, s);
                } else {
                    float lanes[8];
                    _mm256_storeu_ps(lanes, s);
                    memcpy(out, lanes, sizeof(float) * n);
                }
            }
        }
    }
}

/* out[h * D + d ..] += sum_j w[h * w_stride + j] v_j[d ..] over `count` value rows `stride` elements apart,
 * STRIPS 8-lane strips of dimensions from d, for HEADS heads (literals: the HEADS x STRIPS sums stay in
 * registers), in the order of j; each row's strip read (and, int8, converted) once for all the heads. */
static inline __attribute__((always_inline)) void value_strips(const float *w, int64_t w_stride, const void *rows,
                                                               int64_t stride, int64_t count, const int CODES,
                                                               const int HEADS, const int STRIPS, int64_t d,
                                                               int64_t D, float *out) {
    __m256 acc[4][8];
    for (int h = 0; h < HEADS; h++)
        for (int i = 0; i < STRIPS; i++) acc[h][i] = _mm256_loadu_ps(out + h * D + d + 8 * i);
    for (int64_t j = 0; j < count; j++) {
        const void *row = CODES ? (const void *)((const int8_t *)rows + j * stride)
                                : (const void *)((const float *)rows + j * stride);
        __m256 weight[4];
        for (int h = 0; h < HEADS; h++) weight[h] = _mm256_set1_ps(w[h * w_stride + j]);
        for (int i = 0; i < STRIPS; i++) {
            const __m256 x = key_strip(row, CODES, d + 8 * i);
            for (int h = 0; h < HEADS; h++) acc[h][i] = _mm256_fmadd_ps(weight[h], x, acc[h][i]);
        }
    }
    for (int h = 0; h < HEADS; h++)
        for (int i = 0; i < STRIPS; i++) _mm256_storeu_ps(out + h * D + d + 8 * i, acc[h][i]);
}

/* out[h] += sum_j p[h * L + j] v_j for one KV head's `group` query heads over the `count` positions of
 * block `block` from `in_block` on, in the order of j. int8 values are their codes times their scales,
 * the scale folded into the weight (p_j s_j, in `scratch`: 4 * count floats) so each code is converted
 * once for up to four heads. */
static void run_values(const float *p, int64_t L, const KVRows *values, int64_t block, int64_t in_block,
                       int64_t count, int64_t group, int64_t D, float *out, float *scratch) {
    const int64_t at = kv_at(values, block, in_block), stride = values->token_stride;
    for (int64_t h0 = 0; h0 < group; h0 += 4) {
        const int64_t heads = group - h0 < 4 ? group - h0 : 4;
        const float *w = p + h0 * L;
        int64_t w_stride = L;
        const void *rows = (const float *)values->rows + at;
        if (values->scales) {
            const uint16_t *s = kv_scales_at(values, block, in_block);
            for (int64_t h = 0; h < heads; h++)
                for (int64_t j = 0; j < count; j++) scratch[h * count + j] = w[h * L + j] * _cvtsh_ss(s[j * values->scale_stride]);
            w = scratch, w_stride = count, rows = (const int8_t *)values->rows + at;
        }
        float *o = out + h0 * D;
#define VALUES(CODES, HEADS, STRIPS)                                                                            \
    {                                                                                                           \
        int64_t d = 0;                                                                                          \
        for (; d + 8 * (STRIPS) <= D; d += 8 * (STRIPS))                                                        \
            value_strips(w, w_stride, rows, stride, count, CODES, HEADS, STRIPS, d, D, o);                      \
        for (; d < D; d += 8) value_strips(w, w_stride, rows, stride, count, CODES, HEADS, 1, d, D, o);         \
    }
#define HEADS_VALUES(CODES) \
    switch (heads) { case 1: VALUES(CODES, 1, 8) break; case 2: VALUES(CODES, 2, 4) break; \
                     case 3: VALUES(CODES, 3, 4) break; default: VALUES(CODES, 4, 2) break; }
        if (values->scales)
            HEADS_VALUES(1)
        else
            HEADS_VALUES(0)
#undef HEADS_VALUES
#undef VALUES
    }
}

/* The runs of positions [first, first + L) in a paged cache of `block_size` positions a block (one
 * division per run, not per position): BODY runs with `block` the run's block, `in_block` its first
 * position there, t0 its first index and `count` its length. */
#define FOR_RUNS(table, block_size, BODY)                                                                       \
    for (int64_t t0 = 0; t0 < L;) {                                                                             \
        const int64_t pos = first + t0, in_block = pos % (block_size), block = (table)[pos / (block_size)];     \
        const int64_t count = (block_size) - in_block < L - t0 ? (block_size) - in_block : L - t0;              \
        BODY                                                                                                    \
        t0 += count;                                                                                            \
    }

/* One sequence's H query heads over its positions [first, first + L), every KV head of a run read
 * together (the cache streams in address order): scores, a softmax per head, the weighted values into
 * out [H, D]. With `stats` (flash-decoding's split: a part of the positions), unnormalized: out[h] =
 * sum_t e^(s_t - top_h) v_t, stats[2h] = top_h, stats[2h + 1] = sum_t e^(s_t - top_h); L may then be 0
 * (top -inf, sum 0, out 0). p: scratch of H * L floats; weights: 4 * block_size floats for int8 caches.
 * Sinks (gpt-oss): head h's logit sinks[h] joins its softmax's denominator and attends to nothing. */
typedef struct {
    const void *cache;      /* [2, num_blocks, block_size, KVH, D]: float32, or int8 codes */
    const uint16_t *scales; /* int8: float16 [2, num_blocks, block_size, KVH] (NULL: float32) */
    int64_t H, KVH, D, num_blocks, block_size;
    float scale;
    const float *sinks; /* [H] (NULL: none) */
} CacheGeometry;

/* p[0..L) = e^(p - top) / (sum + e^(sink - top)) in place: a softmax with a sink's logit in its denominator. */
static inline void softmax_with_sink(float *p, int64_t L, float sink) {
    float top;
    const float total = exp_in_place(p, L, &top) + expf(sink - top);
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < L; t++) p[t] *= inv;
}

static void attend_sequence(const CacheGeometry *c, const float *q, const int64_t *table, int64_t first, int64_t L,
                            float *p, float *weights, float *out, float *stats) {
    const int64_t H = c->H, KVH = c->KVH, D = c->D, group = H / KVH;
    KVRows k, v;
    FOR_RUNS(table, c->block_size,
        for (int64_t kvh = 0; kvh < KVH; kvh++) {
            kv_head_rows(c->cache, c->scales, kvh, KVH, D, table, c->block_size, c->num_blocks, &k, &v);
            run_scores(q + kvh * group * D, &k, block, in_block, count, group, D, c->scale,
                       p + kvh * group * L + t0, L);
        })
    for (int64_t h = 0; h < H; h++) {
        if (stats)
            stats[2 * h + 1] = exp_in_place(p + h * L, L, stats + 2 * h);
        else if (c->sinks)
            softmax_with_sink(p + h * L, L, c->sinks[h]);
        else
            softmax_in_place(p + h * L, L);
    }
    memset(out, 0, sizeof(float) * H * D);
    FOR_RUNS(table, c->block_size,
        for (int64_t kvh = 0; kvh < KVH; kvh++) {
            kv_head_rows(c->cache, c->scales, kvh, KVH, D, table, c->block_size, c->num_blocks, &k, &v);
            run_values(p + kvh * group * L + t0, L, &v, block, in_block, count, group, D, out + kvh * group * D, weights);
        })
}

/* out[h] = softmax-weighted values over all P parts of attend_sequence's split (part i's at outs + i * H * D,
 * stats + 2 * i * H): each part rescaled by e^(top_i - top) for the overall top; a sink's e^(sink - top)
 * joins the denominator. */
static void merge_parts(const float *outs, const float *stats, int64_t P, int64_t H, int64_t D, const float *sinks,
                        float *out) {
    for (int64_t h = 0; h < H; h++) {
        float top = -INFINITY, total = 0;
        for (int64_t i = 0; i < P; i++) top = stats[2 * (i * H + h)] > top ? stats[2 * (i * H + h)] : top;
        float *o = out + h * D;
        memset(o, 0, sizeof(float) * D);
        for (int64_t i = 0; i < P; i++) {
            const float *st = stats + 2 * (i * H + h);
            if (st[1] == 0.0f) continue; /* an empty part */
            const float w = expf(st[0] - top);
            total += w * st[1];
            const float *part = outs + (i * H + h) * D;
            for (int64_t d = 0; d < D; d++) o[d] += w * part[d];
        }
        if (sinks) total += expf(sinks[h] - top);
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

/* A decode batch's attention: B sequences, each one query token of H heads (sequence b's at q +
 * b * q_stride) against its cached positions max(0, lens[b] - window) .. lens[b] - 1 (window <= 0: all)
 * through its block table (tables + b * table_width) → out [B, H * D]. */
typedef struct {
    CacheGeometry cache;
    const float *q;
    int64_t q_stride, B, table_width, window;
    const int64_t *tables, *lens;
    float *out;
    float *part_out, *part_stats; /* split_parts(B) > 1: B * parts * H * D and B * parts * H * 2 floats */
} DecodeAttention;

/* Into how many parts each sequence's positions split: 1, or — where the B sequences do not share out
 * evenly over the threads and some sequence attends to at least SPLIT_MIN_POSITIONS positions — enough
 * that they do (flash-decoding's split, merged after a barrier). A decode step has streamed every weight
 * since a layer's keys and values were last read, so they come from memory, at one core's bandwidth
 * unless split: at batch 1 from 64 positions on (Gemma 3 270M, 15-215 positions: 560 -> 410 us a step). */
#define SPLIT_MIN_POSITIONS 64
static inline int64_t gcd64(int64_t a, int64_t b) { return b ? gcd64(b, a % b) : a; }
static int64_t split_parts(const DecodeAttention *a, int64_t threads) {
    if (threads == 1 || a->B % threads == 0) return 1;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t len = a->lens[b];
        if ((a->window > 0 && len > a->window ? a->window : len) >= SPLIT_MIN_POSITIONS)
            return threads / gcd64(a->B, threads);
    }
    return 1;
}

/* Task `task` of P parts a sequence: its sequence b, and its positions [*first, *first + *L). */
static inline int64_t attention_task(const DecodeAttention *a, int64_t task, int64_t P, int64_t *first, int64_t *L) {
    const int64_t b = task / P, part = task % P, len = a->lens[b];
    const int64_t start = a->window > 0 && len > a->window ? len - a->window : 0, positions = len - start;
    const int64_t per = (positions + P - 1) / P, from = part * per < positions ? part * per : positions;
    *first = start + from;
    *L = (from + per < positions ? from + per : positions) - from;
    return b;
}

/* Inside a parallel region, before the layer's qkv linear: each thread prefetches the keys and values its
 * tasks of decode_attention will read (the same static schedule over the same tasks gives each thread the
 * same ones), up to KV_PREFETCH_BYTES, so they arrive while the weights stream: a decode step has streamed
 * every weight since they were last read, so they come from memory (SmolLM2 at 15-315 positions, processes
 * alternating: the fused step 4.4-5.1 -> 4.2-4.5 ms a token). Numerics unchanged. */
#define KV_PREFETCH_BYTES (256 << 10)
static void prefetch_attention(const DecodeAttention *a) {
    const CacheGeometry *c = &a->cache;
    const int64_t P = split_parts(a, omp_get_num_threads());
    const int64_t token_bytes = c->KVH * c->D * (c->scales ? 1 : (int64_t)sizeof(float)), block_bytes = c->block_size * token_bytes;
    const char *keys = c->cache, *values = keys + c->num_blocks * block_bytes;
    int64_t budget = KV_PREFETCH_BYTES;
#pragma omp for schedule(static) nowait
    for (int64_t task = 0; task < a->B * P; task++) {
        int64_t first, L;
        const int64_t *table = a->tables + attention_task(a, task, P, &first, &L) * a->table_width;
        FOR_RUNS(table, c->block_size,
            const int64_t from = block * block_bytes + in_block * token_bytes;
            for (int64_t at = from; at < from + count * token_bytes && budget > 0; at += 64) {
                _mm_prefetch(keys + at, _MM_HINT_T0);
                _mm_prefetch(values + at, _MM_HINT_T0);
                budget -= 128;
            })
    }
}

/* Inside a parallel region, called by every thread alike: the tasks (a sequence, or a part of one) shared
 * out over the threads, then the parts merged; returns after a barrier. */
static void decode_attention(const DecodeAttention *a) {
    const CacheGeometry *c = &a->cache;
    const int64_t P = split_parts(a, omp_get_num_threads()), H = c->H, D = c->D;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < a->B * P; task++) {
        int64_t first, L;
        const int64_t b = attention_task(a, task, P, &first, &L);
        float *p = malloc(sizeof(float) * H * (L > 0 ? L : 1));
        float *weights = c->scales ? malloc(sizeof(float) * 4 * c->block_size) : NULL;
        const float *q = a->q + b * a->q_stride;
        const int64_t *table = a->tables + b * a->table_width;
        if (P == 1)
            attend_sequence(c, q, table, first, L, p, weights, a->out + b * H * D, NULL);
        else
            attend_sequence(c, q, table, first, L, p, weights, a->part_out + task * H * D,
                            a->part_stats + task * H * 2);
        free(p), free(weights);
    }
    if (P > 1) {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < a->B; b++)
            merge_parts(a->part_out + b * P * H * D, a->part_stats + b * P * H * 2, P, H, D, c->sinks, a->out + b * H * D);
    }
}

/* RoPE (rotate-half) of one head vector in place, as PyTorch's x * cos + rotate_half(x) * sin: two
 * products and one add per element, never contracted into an FMA, so the bits are PyTorch's (8 lanes
 * at a time where D / 2 is a multiple of 8). */
__attribute__((optimize("fp-contract=off"))) static void rotate_half(float *x, const float *cos, const float *sin,
                                                                      int64_t D, float *tmp) {
    const int64_t half = D / 2;
    if (half % 8 == 0) {
        for (int64_t i = 0; i < half; i += 8) {
            const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + half + i);
            const __m256 neg_hi = _mm256_sub_ps(_mm256_setzero_ps(), hi);
            _mm256_storeu_ps(tmp + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                                    _mm256_mul_ps(neg_hi, _mm256_loadu_ps(sin + i))));
            _mm256_storeu_ps(tmp + half + i, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + i)),
                                                           _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + i))));
        }
    } else {
        for (int64_t i = 0; i < D; i++) {
            float partner = i < half ? -x[i + half] : x[i - half];
            float a = x[i] * cos[i], b = partner * sin[i];
            tmp[i] = a + b;
        }
    }
    memcpy(x, tmp, sizeof(float) * D);
}
