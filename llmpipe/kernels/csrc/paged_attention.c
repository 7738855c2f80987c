/* Decode attention straight from a float32 paged KV cache: one query token per sequence against
 * its cached keys, read in place through the block table (no gather copy), float32 throughout.
 *
 * q [B, H, D], cache [2, num_blocks, block_size, KVH, D] (K then V), block_tables [B, W] (int64),
 * lens [B] tokens cached (including the new one), out [B, H, D]. Sequence b attends to positions
 * max(0, lens[b] - window) .. lens[b] - 1 (window <= 0: all). Query head h reads KV head
 * h / (H / KVH). Requires D % 8 == 0.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

void paged_decode_attention(const float *q, const float *cache, const int64_t *block_tables, const int64_t *lens,
                            float *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t num_blocks,
                            int64_t block_size, int64_t table_width, float scale, int64_t window) {
    const int64_t group = H / KVH, token_stride = KVH * D, block_stride = block_size * token_stride;
    const float *keys = cache, *values = cache + num_blocks * block_stride;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < B * KVH; task++) {
        int64_t b = task / KVH, kvh = task % KVH, len = lens[b];
        int64_t first = window > 0 && len > window ? len - window : 0, L = len - first;
        float *p = malloc(sizeof(float) * group * (L > 0 ? L : 1));
        const float *qh = q + (b * H + kvh * group) * D;
        attend(qh, keys + kvh * D, values + kvh * D, block_tables + b * table_width, first, L, group, block_size,
               token_stride, block_stride, D, scale, p, out + (b * H + kvh * group) * D);
        free(p);
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

/* A decode-only batch's attention in one call: qkv [B, H + 2 KVH, D] (the fused projection's
 * output, rotated in place), RoPE on q and k heads with cos / sin [B, D], k and v written to the
 * cache at slots[b], then paged_decode_attention on the rotated queries → out [B, H × D]. */
void rope_write_decode_attention(float *qkv, const float *cos, const float *sin, float *cache, const int64_t *slots,
                                 const int64_t *block_tables, const int64_t *lens, float *out, int64_t B, int64_t H,
                                 int64_t KVH, int64_t D, int64_t num_blocks, int64_t block_size, int64_t table_width,
                                 float scale, int64_t window) {
    const int64_t row = (H + 2 * KVH) * D, token_stride = KVH * D, block_stride = block_size * token_stride;
    float *q = malloc(sizeof(float) * B * H * D), *tmp = malloc(sizeof(float) * D);
    for (int64_t b = 0; b < B; b++) {
        float *heads = qkv + b * row;
        for (int64_t h = 0; h < H + KVH; h++) rotate_half(heads + h * D, cos + b * D, sin + b * D, D, tmp);
        memcpy(q + b * H * D, heads, sizeof(float) * H * D);
        memcpy(cache + slots[b] * token_stride, heads + H * D, sizeof(float) * token_stride);
        memcpy(cache + num_blocks * block_stride + slots[b] * token_stride, heads + (H + KVH) * D,
               sizeof(float) * token_stride);
    }
    paged_decode_attention(q, cache, block_tables, lens, out, B, H, KVH, D, num_blocks, block_size, table_width,
                           scale, window);
    free(q);
    free(tmp);
}
