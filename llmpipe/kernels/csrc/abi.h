/* What the Python side and the C side share, defined once: the C sources and ops.cpp include this
 * file, and llmpipe/kernels/abi.py reads its #defines (integers, or sums and products of earlier ones).
 * decode_step.c checks its descriptor structs against the word counts at compile time. */
#pragma once

#define MAX_ROWS 8 /* activation rows one row-kernel call takes (callers split larger batches) */

/* decode_step.c's LinearDesc as int64 words: kind, bits, weight, scale, offset, bias, N, K, group, panels, lora */
#define LINEAR_WORDS 11
/* its LoraDesc (a LinearDesc's `lora`): a, bt, widths, row_slot, R */
#define LORA_WORDS 5
/* its LayerDesc: 2 norms, 4 LinearDescs, 4 optional norms, act, rope, window, sinks, table, the cache and its scales */
#define LAYER_WORDS (2 + 4 * LINEAR_WORDS + 4 + 5 + 2)
#define LAYER_ROPE_WORD (2 + 4 * LINEAR_WORDS + 4 + 1)
#define LAYER_TABLE_WORD (LAYER_ROPE_WORD + 3)

/* A LinearDesc's kind */
#define KIND_F32 0
#define KIND_INT4 1
#define KIND_INT8 2
#define KIND_Q5_0 3
#define KIND_GGML 4
/* A mixture of experts' MLP, in a LayerDesc's gate_up and down: `weight` points at an ExpertsDesc (E, top_k,
 * renormalize, the clamped SwiGLU's alpha and limit as float64 bits, the router's F32 LinearDesc, then each
 * expert's gate_up LinearDesc and each one's down); N is 2 × top_k × an expert's width, K the hidden size. */
#define KIND_EXPERTS 5
#define EXPERTS_HEADER_WORDS (5 + LINEAR_WORDS)

/* A LayerDesc's act (CLAMPED_SWIGLU: gpt-oss's experts, its alpha and limit in their ExpertsDesc) */
#define ACT_SILU 0
#define ACT_GELU_TANH 1
#define ACT_CLAMPED_SWIGLU 2
