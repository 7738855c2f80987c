/* Decode attention straight from a paged KV cache: one query token per sequence against its cached
 * keys, read in place through the block table (no gather copy), float32 throughout.
 *
 * q [B, H, D], cache [2, num_blocks, block_size, KVH, D] (K then V): float32, or int8 codes with
 * `scales` their float16 scales [2, num_blocks, block_size, KVH] (NULL: float32), block_tables [B, W] (int64),
 * lens [B] tokens cached (including the new one), out [B, H, D]. Sequence b attends to positions
 * max(0, lens[b] - window) .. lens[b] - 1 (window <= 0: all). Query head h reads KV head
 * h / (H / KVH); its sink logit sinks[h] (sinks NULL: none) joins its softmax's denominator. Requires D % 8 == 0.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_rows.h"

void paged_decode_attention(const float *q, const void *cache, const uint16_t *scales, const int64_t *block_tables,
                            const int64_t *lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                            int64_t num_blocks, int64_t block_size, int64_t table_width, float scale, int64_t window,
                            const float *sinks) {
    const int64_t parts = omp_get_max_threads();
    float *part_out = malloc(sizeof(float) * B * parts * H * D), *part_stats = malloc(sizeof(float) * B * parts * H * 2);
    const DecodeAttention a = {{cache, scales, H, KVH, D, num_blocks, block_size, scale, sinks}, q, H * D, B, table_width,
                               window, block_tables, lens, out, part_out, part_stats};
#pragma omp parallel
    decode_attention(&a);
    free(part_out), free(part_stats);
}

/* RoPE in place on the first `rotated` heads of each row of heads [T, row_heads, D] (a step's q and k heads),
 * with cos / sin [T, D]: apply_rotary's bits (rotate_half), and no temporaries the size of the step. */
void rope_heads(float *heads, const float *cos, const float *sin, int64_t T, int64_t row_heads, int64_t rotated,
                int64_t D) {
#pragma omp parallel if (T * rotated * D >= 1 << 16)
    {
        float *tmp = malloc(sizeof(float) * D);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < rotated; h++) rotate_half(heads + (t * row_heads + h) * D, cos + t * D, sin + t * D, D, tmp);
        free(tmp);
    }
}

/* A decode-only batch's attention in one call: qkv [B, H + 2 KVH, D] (the fused projection's
 * output, rotated in place), RoPE on q and k heads with cos / sin [B, D], k and v written to the
 * cache at slots[b], then paged_decode_attention on the rotated queries → out [B, H × D]. */
void rope_write_decode_attention(float *qkv, const float *cos, const float *sin, float *cache, const int64_t *slots,
                                 const int64_t *block_tables, const int64_t *lens, float *out, int64_t B, int64_t H,
                                 int64_t KVH, int64_t D, int64_t num_blocks, int64_t block_size, int64_t table_width,
                                 float scale, int64_t window, const float *sinks) {
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
    paged_decode_attention(q, cache, NULL, block_tables, lens, out, B, H, KVH, D, num_blocks, block_size, table_width,
                           scale, window, sinks);
    free(q);
    free(tmp);
}
