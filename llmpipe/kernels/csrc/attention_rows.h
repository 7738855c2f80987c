/* Decode attention's pieces (layout: paged_attention.c), shared by paged_attention.c and decode_step.c
 * (which also reads and writes int8 caches: KVRows, quantize_kv_row). */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
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
    for (int64_t t = 0; t < L; t++) top = p[t] > top ? p[t] : top;
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sums = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) {
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

/* One KV head's keys (or values) in a paged cache: float32 rows, or int8 codes with a float16 scale per
 * position and KV head (quant/kv.py's int8 cache), dequantized a block's run of positions at a time
 * into `run` — as the layer-by-layer path dequantizes (code times scale, in float32), so attention then
 * computes on the same values. */
typedef struct {
    const void *rows;         /* the head's first element: float, or int8 codes */
    const uint16_t *scales;   /* int8: the head's first scale (NULL: float32 rows) */
    const int64_t *table;     /* the sequence's block table */
    int64_t block_size, token_stride, block_stride; /* elements between positions / blocks */
    int64_t scale_stride;     /* scales between positions (KVH) */
    float *run;               /* int8: block_size * D floats of scratch */
} KVRows;

/* KV head kvh's keys and values for one sequence (block table `table`) in a cache [2, num_blocks,
 * block_size, KVH, D]: float32, or int8 codes with `scales` [2, num_blocks, block_size, KVH] (NULL: float32);
 * `run`: block_size * D floats of scratch for int8. */
static inline void kv_head_rows(const void *cache, const uint16_t *scales, int64_t kvh, int64_t KVH, int64_t D,
                                const int64_t *table, int64_t block_size, int64_t num_blocks, float *run, KVRows *k,
                                KVRows *v) {
    const int64_t token_stride = KVH * D, block_stride = block_size * token_stride, half = num_blocks * block_stride;
    const char *base = cache;
    const int64_t element = scales ? 1 : sizeof(float);
    *k = (KVRows){base + kvh * D * element, scales ? scales + kvh : NULL, table, block_size, token_stride, block_stride,
                  KVH, run};
    *v = *k;
    v->rows = base + (half + kvh * D) * element;
    v->scales = scales ? scales + half / D + kvh : NULL;
}

/* The first of `count` positions in block `block` from `in_block` on, `width` elements from `offset`:
 * a pointer to float rows `*stride` apart (the cache itself, or `run` dequantized). */
static inline const float *kv_run(const KVRows *src, int64_t block, int64_t in_block, int64_t count, int64_t offset,
                                  int64_t width, int64_t *stride) {
    const int64_t at = block * src->block_stride + in_block * src->token_stride + offset;
    if (!src->scales) {
        *stride = src->token_stride;
        return (const float *)src->rows + at;
    }
    const int8_t *codes = (const int8_t *)src->rows + at;
    const uint16_t *scales = src->scales + (block * src->block_size + in_block) * src->scale_stride;
    for (int64_t j = 0; j < count; j++) {
        const __m256 s = _mm256_set1_ps(_cvtsh_ss(scales[j * src->scale_stride]));
        for (int64_t d = 0; d < width; d += 8) {
            const __m128i c = _mm_loadl_epi64((const __m128i *)(codes + j * src->token_stride + d));
            _mm256_storeu_ps(src->run + j * width + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), s));
        }
    }
    *stride = width;
    return src->run;
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

/* p[h * L + t] = scale * <q_h, k_t> for HEADS (1..8, a literal) heads at once, k_t read once for all of
 * them. Up to four heads take two FMA chains each (even and odd 8-lane strips of the dimensions): one
 * chain a head waits on FMA latency at every step; more heads already interleave enough chains. */
static inline __attribute__((always_inline)) void head_scores(const float *q, const float *k, const int HEADS, int64_t D,
                                                              float scale, float *p, int64_t L, int64_t t) {
    __m256 acc[8], odd[8];
    for (int h = 0; h < HEADS; h++) acc[h] = odd[h] = _mm256_setzero_ps();
    int64_t d = 0;
    if (HEADS <= 4)
        for (; d + 16 <= D; d += 16) {
            const __m256 k0 = _mm256_loadu_ps(k + d), k1 = _mm256_loadu_ps(k + d + 8);
            for (int h = 0; h < HEADS; h++) {
                acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), k0, acc[h]);
                odd[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d + 8), k1, odd[h]);
            }
        }
    for (; d < D; d += 8) {
        const __m256 kd = _mm256_loadu_ps(k + d);
        for (int h = 0; h < HEADS; h++) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), kd, acc[h]);
    }
    for (int h = 0; h < HEADS; h++) p[h * L + t] = hsum(_mm256_add_ps(acc[h], odd[h])) * scale;
}

/* The positions [first, first + L) of a paged cache, a block's run at a time (one division per run, not
 * per position; int8 rows dequantized once a run): BODY runs with `row` pointing at the run's first
 * position (`width` elements from `offset`), `stride` floats between its positions, t0 the run's first
 * index and `count` its length. */
#define FOR_RUNS(src, offset, width, BODY)                                                                      \
    for (int64_t t0 = 0; t0 < L;) {                                                                             \
        const int64_t pos = first + t0, in_block = pos % (src)->block_size;                                     \
        const int64_t count = (src)->block_size - in_block < L - t0 ? (src)->block_size - in_block : L - t0;    \
        int64_t stride;                                                                                         \
        const float *row = kv_run(src, (src)->table[pos / (src)->block_size], in_block, count, offset, width, &stride); \
        BODY                                                                                                    \
        t0 += count;                                                                                            \
    }

/* p[h * L + t] = scale * <q_h, k_t> for one KV head's `group` query heads over positions [first, first + L). */
static void group_scores(const float *q, const KVRows *keys, int64_t first, int64_t L, int64_t group, int64_t D,
                         float scale, float *p) {
#define SCORES(HEADS) head_scores(q + h0 * D, row, HEADS, D, scale, p + h0 * L, L, t)
    FOR_RUNS(keys, 0, D,
        for (int64_t j = 0, t = t0; j < count; j++, t++, row += stride)
            for (int64_t h0 = 0; h0 < group; h0 += 8) {
                const int64_t heads = group - h0 < 8 ? group - h0 : 8;
                FOR_ROWS(heads, SCORES)
            })
#undef SCORES
}

/* out[h] = sum_t p[h * L + t] v_t over the same positions, 64 dimensions at a time: each run's values
 * (dequantized once) meet every head, whose sums carry from run to run in `out`, in the order of t. */
static void weighted_values(const float *p, const KVRows *values, int64_t first, int64_t L, int64_t group, int64_t D,
                            float *out) {
    for (int64_t strip = 0; strip < D; strip += 64) {
        const int64_t lanes = (D - strip < 64 ? D - strip : 64) / 8;
        for (int64_t h = 0; h < group; h++) memset(out + h * D + strip, 0, sizeof(float) * 8 * lanes);
#define WEIGHTED_VALUES(LANES)                                                                                  \
    {                                                                                                           \
        __m256 acc[8];                                                                                          \
        for (int i = 0; i < LANES; i++) acc[i] = _mm256_loadu_ps(o + 8 * i);                                    \
        const float *r = row;                                                                                   \
        for (int64_t j = 0; j < count; j++, r += stride) {                                                      \
            const __m256 w = _mm256_set1_ps(ph[j]);                                                             \
            for (int i = 0; i < LANES; i++) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8 * i), acc[i]);    \
        }                                                                                                       \
        for (int i = 0; i < LANES; i++) _mm256_storeu_ps(o + 8 * i, acc[i]);                                    \
    }
        FOR_RUNS(values, strip, 8 * lanes,
            for (int64_t h = 0; h < group; h++) {
                const float *ph = p + h * L + t0;
                float *o = out + h * D + strip;
                if (lanes == 8) /* a literal bound: the accumulators stay in registers */
                    WEIGHTED_VALUES(8)
                else
                    WEIGHTED_VALUES(lanes)
            })
#undef WEIGHTED_VALUES
    }
}

/* One sequence, one KV head, its `group` query heads; p: scratch of group * L floats. Scores, then a
 * softmax per head, then the weighted values. */
static void attend(const float *q, const KVRows *keys, const KVRows *values, int64_t first, int64_t L, int64_t group,
                   int64_t D, float scale, float *p, float *out) {
    group_scores(q, keys, first, L, group, D, scale, p);
    for (int64_t h = 0; h < group; h++) softmax_in_place(p + h * L, L);
    weighted_values(p, values, first, L, group, D, out);
}

/* attend over one part of the positions, unnormalized (flash-decoding's split): out[h] = sum_t
 * e^(s_t - top_h) v_t, stats[2h] = top_h, stats[2h + 1] = sum_t e^(s_t - top_h); merge_parts combines
 * the parts. L may be 0 (top -inf, sum 0, out 0). */
static void attend_part(const float *q, const KVRows *keys, const KVRows *values, int64_t first, int64_t L,
                        int64_t group, int64_t D, float scale, float *p, float *out, float *stats) {
    group_scores(q, keys, first, L, group, D, scale, p);
    for (int64_t h = 0; h < group; h++) stats[2 * h + 1] = exp_in_place(p + h * L, L, stats + 2 * h);
    weighted_values(p, values, first, L, group, D, out);
}

/* out[h] = softmax-weighted values over all P parts of attend_part (part i's at outs + i * group * D,
 * stats + 2 * i * group): each part rescaled by e^(top_i - top) for the overall top. */
static void merge_parts(const float *outs, const float *stats, int64_t P, int64_t group, int64_t D, float *out) {
    for (int64_t h = 0; h < group; h++) {
        float top = -INFINITY, total = 0;
        for (int64_t i = 0; i < P; i++) top = stats[2 * (i * group + h)] > top ? stats[2 * (i * group + h)] : top;
        float *o = out + h * D;
        memset(o, 0, sizeof(float) * D);
        for (int64_t i = 0; i < P; i++) {
            const float *st = stats + 2 * (i * group + h);
            if (st[1] == 0.0f) continue; /* an empty part */
            const float w = expf(st[0] - top);
            total += w * st[1];
            const float *part = outs + (i * group + h) * D;
            for (int64_t d = 0; d < D; d++) o[d] += w * part[d];
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
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
