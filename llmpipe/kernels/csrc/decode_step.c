/* A decode step of a Llama-family body (Llama, Mistral, Qwen 3, Gemma 3) in one call: every layer of a
 * decode-only batch (up to MAX_BATCH rows), inside one OpenMP parallel region, the threads meeting at a
 * barrier between the stages of a layer:
 *
 *   RMSNorm → qkv → [q/k RMSNorm] → RoPE + K/V write → attention → o → [RMSNorm] (+ residual)
 *   → RMSNorm → gate/up → act(gate) · up → down → [RMSNorm] (+ residual)
 *
 * (bracketed: where the layer has them — Qwen 3's q/k norms, Gemma 3's q/k norms and output norms;
 * act SiLU or GELU-tanh). At batch 1 the model is a few hundred small matrix-vector products; run one
 * kernel call (and one thread fork/join) each, the calls and the Python between them cost more than the
 * weights take to stream. Here each thread owns a fixed slice of every weight's output rows, so it
 * streams the same bytes every step, and the per-op dispatch is gone. (Handing a GGML weight's rows out
 * 64 or 256 at a time to whichever thread is free cut the threads' waits at the barriers from ~7% to ~2%
 * of an 8B Q4_K_M step on a noisy 2-vCPU host, yet decoded 4-5% slower in an in-process A/B: one long
 * stream per thread feeds the prefetchers better than the other thread's idle time costs; see
 * docs/benchmarks.md, twenty-fourth session.) The arithmetic is the per-op kernels' own (the same row
 * functions, the same row split into pairs), so each linear's result is theirs bit for bit.
 *
 * Weights, per linear (LinearDesc, as layers/decode_step.py lays it out):
 *   F32:  float [N, K]
 *   INT4: codes [N, K / 2] (lowbit_linear.c's layout), scale and offset [N, G]
 *   INT8: codes [N, K], scale [N, G]
 *   Q5_0: GGUF's blocks [N, K / 32 * 22] (lowbit_q5_rows.h: unpacked a row at a time for the INT8 row functions)
 *   GGML: a GGUF file's own blocks (ggml_rows.h), in `group` segments of rows of one type each, `segments`
 *         (type, rows, address of the first byte) per segment (each where the loader left it: views of the
 *         file's mapping); integer-dot activations only, any batch in one pass
 * and, for batches of PANEL_MIN_ROWS or more on the integer-dot path, the same weights as panels
 * (lowbit_panels.h) where given; and, where LoRA adapters are loaded (llmpipe/lora/), their low-rank factors
 * (LoraDesc): each row of the batch adds its own adapter's B · (A · x) to the linear's output, A · x split
 * among the threads (then a barrier), B's columns in each thread's own output rows.
 * with bits = 8 or 16 taking the integer-dot path (activations quantized to int8 or 15-bit blocks,
 * lowbit_dot.c), 0 the float-activation (exact) path. Norm weights are the multipliers themselves
 * (Gemma's 1 + weight, precomputed).
 * x [B, hidden] is the residual stream, updated in place (and, given final_norm, normed by it at the end).
 * cos / sin [R, B, D]: R RoPE tables (Gemma 3: global, local), each layer naming its own; the cache of
 * each layer [2, num_blocks, block_size, KVH, D]: float32, or (a layer with kv_scales) int8 codes with
 * float16 scales [2, num_blocks, block_size, KVH] (quant/kv.py's int8 cache: the new K and V quantized
 * as it quantizes them, read as codes: attention_rows.h);
 * slots [S, B], tables [S, B, W], lens [S, B]: paged_attention.c's, for S caches of their own block
 * tables (Gemma 3's window groups), each layer naming its own.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_rows.h"
#include "ggml_amx.h"
#include <stddef.h>

#include "abi.h"
#include "ggml_rows.h"
#include "float_rows.h"
#include "lowbit_float_rows.h"
#include "lowbit_panels.h"
#include "lowbit_q5_rows.h"
#include "lowbit_q8_rows.h"

enum { F32 = KIND_F32, INT4 = KIND_INT4, INT8 = KIND_INT8, Q5_0 = KIND_Q5_0, GGML = KIND_GGML, EXPERTS = KIND_EXPERTS };

/* A linear's LoRA adapters (lora/slots.py's ModuleSlots): per slot, A [R, K] and B transposed [R, N], zero-padded;
 * widths[slot]: the slot's rank columns here (0: its adapter leaves this linear alone); row_slot[m]: row m's
 * slot this step (-1: the base model). */
typedef struct {
    const float *a, *bt;
    const int64_t *widths, *row_slot;
    int64_t R;
} LoraDesc;

typedef struct {
    int64_t kind, bits; /* bits: the activations' for the integer dot (8, 16), 0 float */
    const void *weight; /* F32 weights or low-bit codes */
    const float *scale;
    union {
        const float *offset;     /* INT4 */
        const int64_t *segments; /* GGML: (type, rows, address) per segment */
    };
    const float *bias; /* may be NULL */
    int64_t N, K, group; /* GGML: group is the segment count */
    const uint8_t *panels; /* with bits: the codes also in lowbit_panels.h's panels, for batches (NULL: none) */
    const LoraDesc *lora;  /* NULL: no adapter changes this linear */
} LinearDesc;

enum { SILU = ACT_SILU, GELU_TANH = ACT_GELU_TANH, CLAMPED_SWIGLU = ACT_CLAMPED_SWIGLU };

typedef struct {
    const float *input_norm, *post_norm; /* before attention, before the MLP */
    LinearDesc qkv, o, gate_up, down;
    const float *q_norm, *k_norm;              /* each q / k head's, before RoPE (NULL: none) */
    const float *attn_out_norm, *mlp_out_norm; /* the attention's / MLP's output, before its residual add (NULL: none) */
    int64_t act;    /* SILU, GELU_TANH or CLAMPED_SWIGLU */
    int64_t rope;   /* which of the R cos / sin tables */
    int64_t window; /* sliding window (0: none) */
    const float *sinks; /* [H]: each head's sink logit in its softmax's denominator (NULL: none) */
    int64_t table;  /* which of the S block-table sets */
    void *kv_cache;      /* float32, or int8 codes */
    uint16_t *kv_scales; /* int8 caches: their float16 scales (NULL: float32) */
} LayerDesc;

typedef struct {
    int64_t experts, top_k, renormalize; /* renormalize: the top-k probabilities rescaled to sum to 1 */
    double swiglu_alpha, swiglu_limit;   /* CLAMPED_SWIGLU's */
    LinearDesc router;                   /* F32 [experts, hidden] (its bias may be set) */
    LinearDesc expert[];                 /* each expert's gate_up, then each one's down */
} ExpertsDesc;

/* The Python side lays these out as abi.h's int64 words. */
_Static_assert(sizeof(LinearDesc) == LINEAR_WORDS * 8, "LinearDesc is LINEAR_WORDS words");
_Static_assert(sizeof(LoraDesc) == LORA_WORDS * 8, "LoraDesc is LORA_WORDS words");
_Static_assert(sizeof(LayerDesc) == LAYER_WORDS * 8, "LayerDesc is LAYER_WORDS words");
_Static_assert(offsetof(LayerDesc, rope) == LAYER_ROPE_WORD * 8, "LayerDesc.rope is word LAYER_ROPE_WORD");
_Static_assert(offsetof(LayerDesc, table) == LAYER_TABLE_WORD * 8, "LayerDesc.table is word LAYER_TABLE_WORD");
_Static_assert(offsetof(ExpertsDesc, expert) == EXPERTS_HEADER_WORDS * 8, "ExpertsDesc's experts follow its header");

/* Per-thread buffers, sized for the widest input (K) and output slice. */
typedef struct {
    float *xn, *y, *y2, *xsum, *dx, *tmp;
    int8_t *qx, *qp; /* qp: qx in the batch-1 INT4 rows' order (lowbit_q8_rows.h: int4_m1_order) */
    int32_t *cg;
    int8_t *codes; /* Q5_0: two weight rows unpacked, and their scales */
    float *scales;
    int32_t *bias; /* Q5_0 on VNNI at batch 1: q5_0_bias's sums */
    int32_t *s4;   /* GGML: activation_sums4's */
    int8_t *amx_b; /* GGML on AMX (a batch of AMX_MIN_ROWS or more): the activations as the tiles read them */
    float *lora_t; /* shared by the threads: [B, R] the rows' A · x of the linear being computed (lora_shrink) */
    float *amx_dx, *amx_xs;
} Scratch;

static Scratch scratch_new(int64_t B, int64_t K, int64_t slice) {
    Scratch s;
    s.xn = malloc(sizeof(float) * B * K);
    s.y = malloc(sizeof(float) * B * slice);
    s.y2 = malloc(sizeof(float) * B * slice);
    s.xsum = malloc(sizeof(float) * B * (K / HALF_GROUP)); /* one per group: half groups the most */
    s.dx = malloc(sizeof(float) * B * (K / BLOCK));
    s.tmp = malloc(sizeof(float) * K);
    s.qx = malloc(activation_bytes(B, K, 2));
    s.qp = malloc(activation_bytes(B, K, 2));
    const int amx = B >= AMX_MIN_ROWS && use_amx();
    s.amx_b = amx ? aligned_alloc(64, amx_act_bytes(B, K, 2)) : NULL;
    s.amx_dx = amx ? malloc(sizeof(float) * amx_act_floats(B, K)) : NULL;
    s.amx_xs = amx ? malloc(sizeof(float) * amx_act_floats(B, K)) : NULL;
    s.cg = malloc(sizeof(int32_t) * (K / BLOCK));
    s.codes = malloc(2 * K);
    s.scales = malloc(sizeof(float) * 2 * (K / BLOCK));
    s.bias = malloc(sizeof(int32_t) * 2 * (K / 4));
    s.s4 = malloc(sizeof(int32_t) * B * (K / 4));
    return s;
}

static void scratch_free(Scratch *s) { free(s->xn), free(s->y), free(s->y2), free(s->xsum), free(s->dx), free(s->tmp), free(s->qx), free(s->qp), free(s->cg), free(s->codes), free(s->scales), free(s->bias), free(s->s4), free(s->amx_b), free(s->amx_dx), free(s->amx_xs); }

/* This thread's output rows [n0, n1) of N: whole fours (so batch 1 runs the per-op kernels' pair and
 * four-row functions on the same rows, for the same bits); for batches, whole panels. */
static void row_range(int64_t N, int64_t B, int64_t *n0, int64_t *n1) {
    thread_rows(N, B >= PANEL_MIN_ROWS ? PANEL : 4, n0, n1);
}

/* 1 / rms(row) of a K-wide row (K a multiple of 8), as torch.rms_norm takes it in float32. */
static float inverse_rms(const float *row, int64_t K, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 v = _mm256_loadu_ps(row + k);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    return 1.0f / sqrtf(hsum(acc) / (float)K + eps);
}

/* out[m] = x[m] / rms(x[m]) * w, as torch.rms_norm computes in float32 (out may be x). */
static void rms_norm_rows(const float *x, const float *w, float *out, int64_t B, int64_t K, float eps) {
    for (int64_t m = 0; m < B; m++) {
        const float *xr = x + m * K;
        const float rstd = inverse_rms(xr, K, eps);
        for (int64_t k = 0; k < K; k++) out[m * K + k] = xr[k] * rstd * w[k];
    }
}

/* x[m, c] += rms_norm(out[m])[c] * w[c] for this thread's columns (each thread takes the row's rms itself):
 * the residual add of a normed output, as x + norm(out) computes it. */
static void add_normed(float *x, const float *out, const float *w, int64_t B, int64_t hidden, float eps) {
    int64_t c0, c1;
    thread_rows(hidden, 8, &c0, &c1);
    for (int64_t m = 0; m < B; m++) {
        const float *row = out + m * hidden;
        const float rstd = inverse_rms(row, hidden, eps);
        for (int64_t c = c0; c < c1; c++) x[m * hidden + c] += row[c] * rstd * w[c];
    }
}

/* ---- one thread's slice of a linear: y[m, n - n0] for n in [n0, n1) ------------------------------- */

static void group_sums(const float *x, int64_t B, int64_t K, int64_t group, float *xsum) { /* as int4_linear's */
    const int64_t G = num_groups(K, group);
    for (int64_t m = 0; m < B; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0;
            for (int64_t k = g * group; k < group_end(g, K, group); k++) s += x[m * K + k];
            xsum[m * G + g] = s;
        }
}

/* A Q5_0 weight's rows [n, n + rows) into s->codes and s->scales. */
static inline void unpack_rows(const LinearDesc *w, int64_t n, int64_t rows, Scratch *s) {
    unpack_q5_0_rows((const uint8_t *)w->weight + n * q5_0_row_bytes(w->K), rows, w->K, s->codes, s->scales);
}

/* exact_slice's INT8 loops on Q5_0 rows unpacked (pairs at batch 1). */
static void q5_0_exact_slice(const LinearDesc *w, const float *x, int64_t B, int64_t n0, int64_t n1, Scratch *s) {
    const int64_t K = w->K, width = n1 - n0;
    float *y = s->y;
    if (B == 1) {
        int64_t n = n0;
        for (; n + 1 < n1; n += 2) unpack_rows(w, n, 2, s), int8_pair(x, s->codes, s->scales, y + n - n0, K, BLOCK);
        if (n < n1) unpack_rows(w, n, 1, s), int8_row(x, s->codes, s->scales, y, n - n0, width, K, BLOCK, 1);
        return;
    }
#define Q5_0_EXACT_ROWS(MR) \
    for (int64_t n = n0; n < n1; n++) unpack_rows(w, n, 1, s), int8_row(x, s->codes, s->scales, y, n - n0, width, K, BLOCK, MR)
    FOR_ROWS(B, Q5_0_EXACT_ROWS)
}

static void exact_slice(const LinearDesc *w, const float *x, int64_t B, int64_t n0, int64_t n1, Scratch *s) {
    const int64_t K = w->K, group = w->group, G = num_groups(K, group), width = n1 - n0;
    float *y = s->y;
    if (w->kind == F32) {
        const float *W = w->weight;
#define F32_ROWS(MR) for (int64_t n = n0; n < n1; n++) output_row(x, W + n * K, y, n - n0, width, K, MR)
        FOR_ROWS(B, F32_ROWS)
        return;
    }
    const float *scale = w->scale, *offset = w->offset;
    if (w->kind == Q5_0) {
        q5_0_exact_slice(w, x, B, n0, n1, s);
        return;
    }
    if (w->kind == INT4) {
        const uint8_t *codes = w->weight;
        group_sums(x, B, K, group, s->xsum);
        if (B == 1) {
            int64_t n = n0;
            for (; n + 1 < n1; n += 2)
                int4_pair(x, codes + n * (K / 2), scale + n * G, offset + n * G, s->xsum, y + n - n0, K, group);
            if (n < n1) int4_row(x, codes + n * (K / 2), scale + n * G, offset + n * G, s->xsum, y, n - n0, width, K, group, 1);
            return;
        }
#define INT4_EXACT_ROWS(MR) \
    for (int64_t n = n0; n < n1; n++) int4_row(x, codes + n * (K / 2), scale + n * G, offset + n * G, s->xsum, y, n - n0, width, K, group, MR)
        FOR_ROWS(B, INT4_EXACT_ROWS)
        return;
    }
    const int8_t *codes = w->weight;
    if (B == 1) {
        int64_t n = n0;
        for (; n + 1 < n1; n += 2) int8_pair(x, codes + n * K, scale + n * G, y + n - n0, K, group);
        if (n < n1) int8_row(x, codes + n * K, scale + n * G, y, n - n0, width, K, group, 1);
        return;
    }
#define INT8_EXACT_ROWS(MR) for (int64_t n = n0; n < n1; n++) int8_row(x, codes + n * K, scale + n * G, y, n - n0, width, K, group, MR)
    FOR_ROWS(B, INT8_EXACT_ROWS)
}

/* The integer-dot slice, once per ISA (the VNNI row functions inline only into VNNI code). */
#define DOT_ROWS(ROW, MR, ROW_BYTES, OFFSET)                                                              \
    for (int64_t n = n0; n < n1; n++) {                                                                 \
        float out[MAX_ROWS];                                                                            \
        ROW((const void *)(codes + n * (ROW_BYTES)), scale + n * G, qx, dx, K, group, cg, out, MR, OFFSET, xsum, B * K, PL); \
        for (int m = 0; m < MR; m++) s->y[m * (n1 - n0) + n - n0] = out[m];                             \
    }
#define DEFINE_DOT_SLICE(NAME, ATTR)                                                  \
    ATTR static void NAME(const LinearDesc *w, int64_t B, int64_t n0, int64_t n1, Scratch *s, int planes) { \
        const int64_t K = w->K, group = w->group, G = num_groups(K, group);                             \
        const float *scale = w->scale, *offset = w->offset;                                             \
        const int8_t *qx = s->qx;                                                                       \
        const float *dx = s->dx, *xsum = s->xsum;                                                       \
        const int32_t *cg = s->cg;                                                                      \
        if (w->kind == INT4) {                                                                          \
            const uint8_t *codes = w->weight;                                                           \
            WITH_PLANES(planes, NAME##_M1_INT4 FOR_ROWS(B, NAME##_INT4));                              \
        } else if (w->kind == Q5_0) { /* the INT8 rows on each row unpacked (VNNI batch 1: the blocks) */ \
            WITH_PLANES(planes, if (B == 1) { NAME##_Q5_0_M1 } else for (int64_t n = n0; n < n1; n++) {  \
                unpack_rows(w, n, 1, s);                                                                \
                FOR_ROWS(B, NAME##_Q5_0);                                                               \
            });                                                                                         \
        } else {                                                                                        \
            const int8_t *codes = w->weight;                                                            \
            WITH_PLANES(planes, NAME##_M1_INT8 FOR_ROWS(B, NAME##_INT8));                              \
        }                                                                                               \
    }
/* Batch 1 takes the four-row functions, as lowbit_dot.c's entry points do. */
#define dot_slice_avx2_M1_INT4 \
    if (B == 1) { M1_LOOP(int4_rows_avx2_m1, AVX2_INT4_STEP, codes, K / 2, scale, offset, G, s->y); return; }
#define dot_slice_avx2_M1_INT8 \
    if (B == 1) { M1_LOOP(int8_rows_avx2_m1, AVX2_INT8_STEP, codes, K, scale, (const float *)NULL, G, s->y); return; }
#define dot_slice_vnni_M1_INT4 \
    if (B == 1) { M1_LOOP(int4_rows_vnni_m1, VNNI_INT4_STEP, codes, K / 2, scale, offset, G, s->y); return; }
#define dot_slice_vnni_M1_INT8 \
    if (B == 1) { M1_LOOP(int8_rows_vnni_m1, VNNI_INT8_STEP, codes, K, scale, (const float *)NULL, G, s->y); return; }
#define dot_slice_avx2_INT4(MR) DOT_ROWS(int4_row_avx2, MR, K / 2, offset + n * G)
#define dot_slice_avx2_INT8(MR) DOT_ROWS(int8_row_avx2, MR, K, NULL)
#define dot_slice_vnni_INT4(MR) DOT_ROWS(int4_row_vnni, MR, K / 2, offset + n * G)
#define dot_slice_vnni_INT8(MR) DOT_ROWS(int8_row_vnni, MR, K, NULL)
#define dot_slice_avx2_Q5_0_M1                                                                          \
    for (int64_t n = n0; n < n1; n++)                                                                   \
        unpack_rows(w, n, 1, s), int8_rows_avx2_m1(s->codes, K, s->scales, qx, dx, K, group, cg, s->y + n - n0, 1, NULL, xsum, K, PL);
#define dot_slice_vnni_Q5_0_M1                                                                          \
    q5_0_bias(qx, K, K, PL, s->bias);                                                                   \
    for (int64_t n = n0; n < n1; n++)                                                                   \
        s->y[n - n0] = q5_0_row_vnni_m1((const uint8_t *)w->weight + n * q5_0_row_bytes(K), qx, dx, s->bias, K, K, PL);
#define Q5_0_DOT_ROW(ROW, MR)                                                                             \
    {                                                                                                   \
        float out[MAX_ROWS];                                                                            \
        ROW(s->codes, s->scales, qx, dx, K, group, cg, out, MR, NULL, xsum, B * K, PL);                 \
        for (int m = 0; m < MR; m++) s->y[m * (n1 - n0) + n - n0] = out[m];                             \
    }
#define dot_slice_avx2_Q5_0(MR) Q5_0_DOT_ROW(int8_row_avx2, MR)
#define dot_slice_vnni_Q5_0(MR) Q5_0_DOT_ROW(int8_row_vnni, MR)
DEFINE_DOT_SLICE(dot_slice_avx2, )
DEFINE_DOT_SLICE(dot_slice_vnni, VNNI)

static void add_bias(const LinearDesc *w, int64_t B, int64_t n0, int64_t n1, float *y) {
    if (w->bias)
        for (int64_t m = 0; m < B; m++)
            for (int64_t n = n0; n < n1; n++) y[m * (n1 - n0) + n - n0] += w->bias[n];
}

/* The panels' slice: every row of the batch at once, each panel's codes read once. */
static void panel_slice(const LinearDesc *w, const float *x, int64_t B, int64_t n0, int64_t n1, Scratch *s) {
    const int planes = w->bits == 16 ? 2 : 1;
    const int kind = w->kind == INT4 ? PANEL_INT4 : PANEL_INT8;
    quantize_rows(x, B, w->K, BLOCK, planes, s->qx, s->dx, s->xsum); /* sums per block: the panels' offsets are */
    if (panels_take_wide_rows(1, kind, planes)) /* qp: as many bytes as two planes */
        widen_planes(s->qx, w->K, B * w->K, B, w->K, (int16_t *)s->qp);
    else
        pack_tiles(s->qx, w->K, B * w->K, B, w->K, planes, s->qp);
    panel_rows(1, kind, planes, w->panels, n0 / PANEL, (n1 + PANEL - 1) / PANEL, s->qp, s->dx, s->xsum, B, n1, w->K,
               s->y, n1 - n0, n0);
}

/* A GGML weight's rows [n0, n1) against the whole batch (the row functions tile it: each weight byte read
 * once), segment by segment, into s->y. */
static void ggml_linear_slice(const LinearDesc *w, const float *x, int64_t B, int64_t n0, int64_t n1, Scratch *s) {
    const int planes = w->bits == 16 ? 2 : 1, amx = s->amx_b != NULL;
    if (ggml_segments_read_codes(w->segments, w->group, B, planes, use_vnni())) { /* else every segment reads x */
        quantize_rows(x, B, w->K, BLOCK, planes, s->qx, s->dx, s->xsum);
        if (amx)
            amx_pack(s->qx, s->dx, s->xsum, B, w->K, planes, 0, amx_tiles(B), s->amx_b, s->amx_dx, s->amx_xs);
        else if (use_vnni()) /* only the VNNI rows read s4 */
            activation_sums4(s->qx, B, w->K, planes, s->s4);
    }
    const GGMLActs a = {s->qx, s->dx, s->xsum, s->s4, w->K, planes, .x = x};
    const AmxActs tiles = {s->amx_b, s->amx_dx, s->amx_xs, B, amx_tiles(B), w->K, planes};
    ggml_segment_rows(w->segments, w->group, n0, n1, &a, amx ? &tiles : NULL, B, use_vnni(), s->y, n1 - n0);
}

/* This thread's rows [n0, n1) of w · x into s->y ([B, n1 - n0]), bias added (no adapters). */
static void base_slice(const LinearDesc *w, const float *x, int64_t B, int64_t n0, int64_t n1, Scratch *s) {
    if (n0 >= n1) return;
    if (w->kind == GGML) {
        ggml_linear_slice(w, x, B, n0, n1, s);
        add_bias(w, B, n0, n1, s->y);
        return;
    }
    if (w->panels && w->bits && B >= PANEL_MIN_ROWS && n0 % PANEL == 0) {
        panel_slice(w, x, B, n0, n1, s);
        add_bias(w, B, n0, n1, s->y);
        return;
    }
    /* The row kernels take up to MAX_ROWS activation rows: a larger batch goes MAX_ROWS at a time (as
     * the per-op path splits it), each run into its own rows of s->y. */
    float *const y = s->y;
    for (int64_t m0 = 0; m0 < B; m0 += MAX_ROWS) {
        const int64_t rows = B - m0 < MAX_ROWS ? B - m0 : MAX_ROWS;
        const float *xm = x + m0 * w->K;
        s->y = y + m0 * (n1 - n0);
        if (w->bits && w->kind != F32) {
            const int planes = w->bits == 16 ? 2 : 1;
            quantize_rows(xm, rows, w->K, w->group, planes, s->qx, s->dx, s->xsum);
            if (rows == 1 && w->kind == INT4) { /* the batch-1 INT4 rows' order */
                int8_t *natural = s->qx;
                int4_m1_order(natural, w->K, planes, use_vnni(), s->qp);
                s->qx = s->qp, s->qp = natural;
            }
            for (int64_t c = 0; c < w->K / BLOCK; c++) s->cg[c] = (int32_t)(c * BLOCK / w->group);
            (use_vnni() ? dot_slice_vnni : dot_slice_avx2)(w, rows, n0, n1, s, planes);
        } else {
            exact_slice(w, xm, rows, n0, n1, s);
        }
    }
    s->y = y;
    add_bias(w, B, n0, n1, y);
}

/* Whether a row of the step reads an adapter that changes w. */
static int lora_rows(const LinearDesc *w, int64_t B) {
    if (!w->lora) return 0;
    for (int64_t m = 0; m < B; m++) {
        const int64_t slot = w->lora->row_slot[m];
        if (slot >= 0 && w->lora->widths[slot]) return 1;
    }
    return 0;
}

static float dot_f32(const float *a, const float *b, int64_t K) {
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (; k < K; k++) sum += a[k] * b[k];
    return sum;
}

/* The shrink: t[m, r] = A_slot[r] · x[m] for each row's adapter, r below its width; the (row, r) pairs shared out
 * among the threads, which meet at the work-sharing loop's barrier. Every thread calls it (lora_rows agrees). */
static void lora_shrink(const LinearDesc *w, const float *x, int64_t B, float *t) {
    const LoraDesc *l = w->lora;
    const int64_t R = l->R, K = w->K;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < B * R; i++) {
        const int64_t m = i / R, r = i % R, slot = l->row_slot[m];
        if (slot >= 0 && r < l->widths[slot]) t[i] = dot_f32(l->a + (slot * R + r) * K, x + m * K, K);
    }
}

/* The expand: y[m, n - n0] += Σ_r t[m, r] · B_slot[n, r] over this thread's output rows [n0, n1). */
static void lora_expand(const LinearDesc *w, int64_t B, int64_t n0, int64_t n1, const float *t, float *y) {
    const LoraDesc *l = w->lora;
    const int64_t R = l->R, N = w->N, width = n1 - n0;
    for (int64_t m = 0; m < B; m++) {
        const int64_t slot = l->row_slot[m];
        if (slot < 0) continue;
        float *ym = y + m * width;
        for (int64_t r = 0; r < l->widths[slot]; r++) {
            const float tr = t[m * R + r], *b = l->bt + (slot * R + r) * N + n0;
            for (int64_t n = 0; n < width; n++) ym[n] += tr * b[n];
        }
    }
}

/* base_slice, plus each row's adapter delta where one changes w (its shrink already in s->lora_t). */
static void linear_slice(const LinearDesc *w, const float *x, int64_t B, int64_t n0, int64_t n1, Scratch *s) {
    base_slice(w, x, B, n0, n1, s);
    if (n0 < n1 && lora_rows(w, B)) lora_expand(w, B, n0, n1, s->lora_t, s->y);
}

/* dst[m, n] = (or +=) w · x for this thread's rows of w. */
static void linear_into(const LinearDesc *w, const float *x, int64_t B, float *dst, int64_t ld, int add, Scratch *s) {
    int64_t n0, n1;
    if (lora_rows(w, B)) lora_shrink(w, x, B, s->lora_t);
    row_range(w->N, B, &n0, &n1);
    linear_slice(w, x, B, n0, n1, s);
    for (int64_t m = 0; m < B; m++)
        for (int64_t n = n0; n < n1; n++) {
            const float v = s->y[m * (n1 - n0) + n - n0];
            dst[m * ld + n] = add ? dst[m * ld + n] + v : v;
        }
}

/* 1 / (1 + e^-z), 8 lanes, through e^-|z| (no overflow): 1 / (1 + t) for z >= 0, t / (1 + t) below. */
static inline __m256 sigmoid8(__m256 z) {
    const __m256 t = exp_nonpositive(_mm256_or_ps(z, _mm256_set1_ps(-0.0f))); /* e^-|z|: the sign bit set */
    const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), t));
    return _mm256_blendv_ps(inv, _mm256_mul_ps(t, inv), z); /* z's sign bit picks t / (1 + t) */
}

/* An activation: its kind and, for CLAMPED_SWIGLU, its sigmoid gain and clamp. */
typedef struct {
    int64_t kind;
    float alpha, limit;
} Act;

/* f(g) · u for 8 lanes: SiLU g · sigmoid(g), or GELU with the tanh approximation, 0.5 g (1 + tanh(w))
 * with w = √(2/π) (g + 0.044715 g³), as g · sigmoid(2w) (the same function: 1 + tanh(w) = 2 sigmoid(2w)),
 * or gpt-oss's clamped SwiGLU, g ≤ limit and |u| ≤ limit, then g · sigmoid(alpha g) · (u + 1).
 * Vectorized, where libm's tanhf / expf a lane at a time took ~20 us for Gemma 3's 1,024 a thread per
 * layer (0.36 ms a token); within a few float32 ulps of PyTorch's (Sleef's) functions. */
static inline __m256 act_times(Act act, __m256 g, __m256 u) {
    __m256 z = g;
    if (act.kind == GELU_TANH) {
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
        z = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, g));
    } else if (act.kind == CLAMPED_SWIGLU) {
        const __m256 limit = _mm256_set1_ps(act.limit);
        g = _mm256_min_ps(g, limit);
        u = _mm256_add_ps(_mm256_max_ps(_mm256_min_ps(u, limit), _mm256_sub_ps(_mm256_setzero_ps(), limit)), _mm256_set1_ps(1.0f));
        z = _mm256_mul_ps(g, _mm256_set1_ps(act.alpha));
    }
    return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(z)), u);
}

/* out[n] = f(g[n]) * u[n] for n < width (act_times' f). */
static void act_rows(Act act, const float *g, const float *u, float *out, int64_t width) {
    int64_t n = 0;
    for (; n + 8 <= width; n += 8)
        _mm256_storeu_ps(out + n, act_times(act, _mm256_loadu_ps(g + n), _mm256_loadu_ps(u + n)));
    if (n < width) { /* the last few through a zero-padded lane set */
        float gl[8] = {0}, ul[8] = {0}, ol[8];
        memcpy(gl, g + n, sizeof(float) * (width - n)), memcpy(ul, u + n, sizeof(float) * (width - n));
        _mm256_storeu_ps(ol, act_times(act, _mm256_loadu_ps(gl), _mm256_loadu_ps(ul)));
        memcpy(out + n, ol, sizeof(float) * (width - n));
    }
}

/* act[m, n] = f(gate[m, n]) * up[m, n] (f: SiLU or GELU-tanh), gate and up the two halves of gate_up's
 * rows: each thread computes the same slice of both, so the product needs no barrier. */
static void gate_up_act(const LinearDesc *w, int64_t kind, const float *x, int64_t B, float *act, Scratch *s) {
    const int64_t I = w->N / 2;
    int64_t n0, n1;
    if (lora_rows(w, B)) lora_shrink(w, x, B, s->lora_t);
    row_range(I, B, &n0, &n1);
    if (n0 >= n1) return;
    const int64_t width = n1 - n0;
    linear_slice(w, x, B, n0, n1, s);
    float *gate = s->y;
    s->y = s->y2, s->y2 = gate; /* the up slice goes to the other buffer */
    linear_slice(w, x, B, I + n0, I + n1, s);
    for (int64_t m = 0; m < B; m++) act_rows((Act){kind, 0, 0}, gate + m * width, s->y + m * width, act + m * I + n0, width);
}

/* A token's experts: the top_k of softmax(logits), their weights the probabilities (renormalized over the
 * k where asked); ties to the lower index. Every thread computes the same, so none waits for another. */
static void route(const float *logits, int64_t E, int64_t k, int64_t renormalize, int64_t *ids, float *weights) {
    float top = logits[0], sum = 0.0f, chosen = 0.0f;
    for (int64_t e = 1; e < E; e++) top = logits[e] > top ? logits[e] : top;
    for (int64_t e = 0; e < E; e++) sum += expf(logits[e] - top);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        ids[j] = best, weights[j] = expf(logits[best] - top) / sum, chosen += weights[j];
    }
    if (renormalize)
        for (int64_t j = 0; j < k; j++) weights[j] /= chosen;
}

/* A linear over `rows` rows with the AMX tiles only where the scratch has them and the rows are enough
 * (an expert's share of a batch may be a row or two). */
static void expert_slice(const LinearDesc *w, const float *x, int64_t rows, int64_t n0, int64_t n1, Scratch *s) {
    int8_t *amx = s->amx_b;
    if (rows < AMX_MIN_ROWS) s->amx_b = NULL;
    base_slice(w, x, rows, n0, n1, s); /* experts take no adapters */
    s->amx_b = amx;
}

/* A mixture of experts' MLP on the B normed rows xn [B, hidden]: the router's logits (every thread a slice,
 * then a barrier); each row's top-k routes, grouped by expert (every thread the same, so none waits for
 * another); each expert that got rows runs once on them all: its gate_up and activation into act (the
 * pairs in expert order, [B k, I]; each thread the same output rows of every expert, so no barrier between
 * them), a barrier, then its down, each row's output weighted and added into that row of x. `gathered`:
 * this thread's [B, hidden] buffer for an expert's rows. */
static void experts_mlp(const LayerDesc *layer, const float *xn, int64_t B, int64_t hidden, float *x, float *logits,
                        float *act, float *gathered, Scratch *s) {
    const ExpertsDesc *d = layer->gate_up.weight;
    const int64_t E = d->experts, k = d->top_k, I = d->expert[0].N / 2, pairs = B * k;
    const Act glu = {layer->act, (float)d->swiglu_alpha, (float)d->swiglu_limit};
    linear_into(&d->router, xn, B, logits, E, 0, s);
#pragma omp barrier
    int64_t *ids = malloc(sizeof(int64_t) * pairs), *order = malloc(sizeof(int64_t) * pairs);
    int64_t *first = calloc(E + 1, sizeof(int64_t));
    float *weights = malloc(sizeof(float) * pairs);
    for (int64_t b = 0; b < B; b++) route(logits + b * E, E, k, d->renormalize, ids + b * k, weights + b * k);
    for (int64_t p = 0; p < pairs; p++) first[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) first[e + 1] += first[e];
    int64_t *next = memcpy(malloc(sizeof(int64_t) * E), first, sizeof(int64_t) * E);
    for (int64_t p = 0; p < pairs; p++) order[next[ids[p]]++] = p; /* pairs by expert, each expert's in row order */
    free(next);
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = first[e + 1] - first[e];
        if (!rows) continue;
        for (int64_t r = 0; r < rows; r++)
            memcpy(gathered + r * hidden, xn + order[first[e] + r] / k * hidden, sizeof(float) * hidden);
        const LinearDesc *gate_up = &d->expert[e];
        int64_t n0, n1;
        row_range(I, rows, &n0, &n1);
        if (n0 < n1) {
            const int64_t width = n1 - n0;
            expert_slice(gate_up, gathered, rows, n0, n1, s);
            float *gate = s->y;
            s->y = s->y2, s->y2 = gate;
            expert_slice(gate_up, gathered, rows, I + n0, I + n1, s);
            for (int64_t r = 0; r < rows; r++)
                act_rows(glu, gate + r * width, s->y + r * width, act + (first[e] + r) * I + n0, width);
        }
    }
#pragma omp barrier
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = first[e + 1] - first[e];
        if (!rows) continue;
        const LinearDesc *down = &d->expert[E + e];
        int64_t n0, n1;
        row_range(down->N, rows, &n0, &n1);
        if (n0 >= n1) continue;
        expert_slice(down, act + first[e] * I, rows, n0, n1, s);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t p = order[first[e] + r];
            float *row = x + p / k * hidden;
            for (int64_t n = n0; n < n1; n++) row[n] += weights[p] * s->y[r * (n1 - n0) + n - n0];
        }
    }
    free(ids), free(order), free(first), free(weights);
}

/* One KV head's new K (or V) into the cache at element `at` (its scale at `at / D`). */
static void cache_row(const LayerDesc *layer, const float *row, int64_t cache_half, int64_t at, int64_t D) {
    if (layer->kv_scales)
        quantize_kv_row(row, D, (int8_t *)layer->kv_cache + cache_half + at, layer->kv_scales + (cache_half + at) / D);
    else
        memcpy((float *)layer->kv_cache + cache_half + at, row, sizeof(float) * D);
}

/* The layer's q and k heads of qkv, in place: normed where it has q/k norms, then rotated; K and V to
 * the cache (V `cache_half` elements after K). */
static void rope_heads(const LayerDesc *layer, float *qkv, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t width,
                       const float *cos, const float *sin, const int64_t *slots, int64_t cache_half,
                       int64_t token_stride, float eps, Scratch *s) {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < B * (H + KVH); task++) {
        const int64_t b = task / (H + KVH), h = task % (H + KVH);
        float *head = qkv + b * width + h * D;
        const float *norm = h < H ? layer->q_norm : layer->k_norm;
        if (norm) rms_norm_rows(head, norm, head, 1, D, eps);
        rotate_half(head, cos + b * D, sin + b * D, D, s->tmp);
        if (h >= H) {
            const int64_t kvh = h - H, at = slots[b] * token_stride + kvh * D;
            cache_row(layer, head, 0, at, D);
            cache_row(layer, qkv + b * width + (H + KVH + kvh) * D, cache_half, at, D);
        }
    }
}

/* The residual add of a linear's output: straight into x, or through its output norm (after a barrier:
 * the norm needs every thread's slice of the row). */
static void add_output(const LinearDesc *w, const float *norm, const float *in, int64_t B, float *x, int64_t hidden,
                       float *out, float eps, Scratch *s) {
    if (!norm) {
        linear_into(w, in, B, x, hidden, 1, s);
        return;
    }
    linear_into(w, in, B, out, hidden, 0, s);
#pragma omp barrier
    add_normed(x, out, norm, B, hidden, eps);
}

void decode_step(float *x, const LayerDesc *layers, int64_t num_layers, int64_t B, int64_t hidden, int64_t H,
                 int64_t KVH, int64_t D, float eps, float scale, const float *cos, const float *sin,
                 const int64_t *slots, const int64_t *tables, int64_t table_width, const int64_t *lens,
                 int64_t num_blocks, int64_t block_size, const float *final_norm) {
    const int64_t width = (H + 2 * KVH) * D;
    int64_t I = 0, E = 0; /* the widest MLP activation (experts: top_k of them), the most experts */
    for (int64_t l = 0; l < num_layers; l++) {
        I = layers[l].gate_up.N / 2 > I ? layers[l].gate_up.N / 2 : I;
        if (layers[l].gate_up.kind == EXPERTS) {
            const int64_t experts = ((const ExpertsDesc *)layers[l].gate_up.weight)->experts;
            E = experts > E ? experts : E;
        }
    }
    int64_t lora_R = 0; /* the widest adapter stack of any linear */
    for (int64_t l = 0; l < num_layers; l++) {
        const LinearDesc *ws[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        for (int i = 0; i < 4; i++)
            if (ws[i]->kind != EXPERTS && ws[i]->lora && ws[i]->lora->R > lora_R) lora_R = ws[i]->lora->R;
    }
    float *lora_t = lora_R ? malloc(sizeof(float) * B * lora_R) : NULL;
    const int64_t token_stride = KVH * D, block_stride = block_size * token_stride;
    int64_t widest = hidden > I ? hidden : I;
    widest = widest > H * D ? widest : H * D;
    const int64_t slice = widest > width ? widest : width;
    float *qkv = malloc(sizeof(float) * B * width), *attn = malloc(sizeof(float) * B * H * D);
    float *act = malloc(sizeof(float) * B * I), *out = malloc(sizeof(float) * B * hidden);
    float *logits = malloc(sizeof(float) * B * (E ? E : 1));
    const int64_t max_parts = omp_get_max_threads();
    float *part_out = malloc(sizeof(float) * B * max_parts * H * D), *part_stats = malloc(sizeof(float) * B * max_parts * H * 2);
#pragma omp parallel
    {
        Scratch s = scratch_new(B, widest, slice);
        s.lora_t = lora_t;
        float *gathered = E ? malloc(sizeof(float) * B * hidden) : NULL; /* an expert's rows of the batch */
        for (int64_t l = 0; l < num_layers; l++) {
            const LayerDesc *layer = layers + l;
            const int64_t cache_half = num_blocks * block_stride; /* V's elements after K's (scales: / D) */
            const int64_t *layer_slots = slots + layer->table * B, *layer_lens = lens + layer->table * B;
            const int64_t *layer_tables = tables + layer->table * B * table_width, window = layer->window;
            const DecodeAttention a = {{layer->kv_cache, layer->kv_scales, H, KVH, D, num_blocks, block_size, scale,
                                        layer->sinks},
                                       qkv, width, B, table_width, window, layer_tables, layer_lens, attn, part_out,
                                       part_stats};
            prefetch_attention(&a); /* the keys and values arrive while qkv's weights stream */
            rms_norm_rows(x, layer->input_norm, s.xn, B, hidden, eps); /* every thread its own copy: no barrier */
            linear_into(&layer->qkv, s.xn, B, qkv, width, 0, &s);
#pragma omp barrier
            rope_heads(layer, qkv, B, H, KVH, D, width, cos + layer->rope * B * D, sin + layer->rope * B * D,
                       layer_slots, cache_half, token_stride, eps, &s);
            decode_attention(&a);
            add_output(&layer->o, layer->attn_out_norm, attn, B, x, hidden, out, eps, &s);
#pragma omp barrier
            rms_norm_rows(x, layer->post_norm, s.xn, B, hidden, eps);
            if (layer->gate_up.kind == EXPERTS) {
                experts_mlp(layer, s.xn, B, hidden, x, logits, act, gathered, &s);
            } else {
                gate_up_act(&layer->gate_up, layer->act, s.xn, B, act, &s);
#pragma omp barrier
                add_output(&layer->down, layer->mlp_out_norm, act, B, x, hidden, out, eps, &s);
            }
#pragma omp barrier
        }
        if (final_norm) { /* the body's last norm, where the step takes it: x leaves as the LM head reads it */
#pragma omp for schedule(static)
            for (int64_t m = 0; m < B; m++) rms_norm_rows(x + m * hidden, final_norm, x + m * hidden, 1, hidden, eps);
        }
        scratch_free(&s);
        free(gathered);
    }
    free(qkv), free(attn), free(act), free(out), free(logits), free(part_out), free(part_stats), free(lora_t);
}
