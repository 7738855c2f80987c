"""Every op of llmpipe's C kernels (torch.ops.llmpipe.*, kernels/csrc/ops.cpp) as a Python function, in one
module (vLLM's _custom_ops): the callers' only way to the library.

The low-bit decode kernels: float activations
(kernels/csrc/lowbit_linear.c, the exact path) or activation blocks quantized to 8 or 16 bits meeting the codes in integer dot
products (kernels/csrc/lowbit_dot.c, as llama.cpp computes with 8; `reference_dot_linear` is their
PyTorch reference).

PyTorch 2.13's CPU low-bit kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) are
fast on this kind of CPU only with bfloat16 activations, and return bfloat16: measured on
SmolLM2 that moves greedy decoding off the float model's tokens at a step where the float
top-2 margin is 0.017. These kernels keep activations, scales and accumulation in float32.
Where the library cannot be built or loaded, `available()` is False and layers dequantize instead.
"""

from __future__ import annotations

import torch

from llmpipe.kernels.abi import MAX_ROWS  # noqa: F401 - rows per row-kernel pass; the ops take any rows, MAX_ROWS at a time
from llmpipe.kernels.build import library as _library

CHUNK = 32  # K (padded) and group sizes are multiples of this (INT8 also takes HALF_GROUP)
HALF_GROUP = 16  # INT8 groups of half a chunk: GGUF Q6_K's sub-blocks
DOT_BLOCK = 32  # activation elements sharing one scale
ACTIVATION_BITS = (8, 16)  # what the integer-dot kernels quantize activations to
GATED_DELTA_MAX_V_DIM = 1024  # csrc/gated_delta.c's MAX_V_DIM
LEVELS = {8: 127, 16: 16256}  # |code| bound per bits (csrc Q8_LEVELS, Q16_LEVELS: 16 bits held as two int8 planes)


def available() -> bool:
    return _library() is not None


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] float32 contiguous (any M, 0 included) → [M, N] float32."""
    return _library().int4_linear(x, codes, scale, offset, group)


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return _library().int8_linear(x, codes, scale, group)


def int4_dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 weight [N, K] of INT4 codes [N, K / 2]: code * scale + offset, bit for bit as in PyTorch."""
    return _library().int4_dequantize(codes, scale, offset, group)


def int8_dequantize(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 weight [N, K] of INT8 codes [N, K]: code * scale."""
    return _library().int8_dequantize(codes, scale, group)


def q5_0_linear(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ a weight held as GGUF Q5_0 blocks [N, K / 32 * 22]: int8_linear's result on
    its unpacked codes (q5_0_unpack), bit for bit."""
    return _library().q5_0_linear(x, blocks)


def q5_0_linear_dot(x: torch.Tensor, blocks: torch.Tensor, bits: int = 8, isa: int = 1) -> torch.Tensor:
    """As q5_0_linear, with int8_linear_dot's integer dots."""
    return _library().q5_0_linear_dot(x, blocks, bits, isa)


def q5_0_unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 blocks [N, K / 32 * 22] → (codes q - 16 int8 [N, K], scales float32 [N, K / 32])."""
    return _library().q5_0_unpack(blocks)


def ggml_linear_dot(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bits: int = 16, isa: int = 2) -> torch.Tensor:
    """x [M, K] @ a weight held as a GGUF file's own blocks of `ggml_type` [N, bytes per row] (the types of
    loader/gguf_weights.GGML_TYPES), with x quantized to `bits` blocks (csrc/ggml_rows.h). `isa`: 0 the AVX2
    rows and panels, 1 the AVX512-VNNI rows and panels, 2 AMX tiles for batches (csrc/ggml_amx.h), each where the
    CPU has it."""
    return _library().ggml_linear_dot(x, blocks, ggml_type, bits, isa)


def ggml_segments_dot(x: torch.Tensor, table: torch.Tensor, N: int, bits: int = 16, isa: int = 2) -> torch.Tensor:
    """x [M, K] @ a weight whose rows are segments of GGUF blocks, `table` int64 [n, 3]: (ggml type, rows, address
    of those rows' blocks) per segment, N rows in all (GGMLLinear.segment_table: its buffers must outlive the
    call). x is quantized once for every segment; as ggml_linear_dot otherwise."""
    return _library().ggml_segments_dot(x, table, N, bits, isa)


def dot_available() -> bool:
    return _library() is not None  # one library holds both kinds of kernel


def dot_isas() -> list[int]:
    """The integer-dot code paths this CPU runs: 0 (AVX2) and, with AVX512-VNNI, 1."""
    return [0, 1] if dot_available() and _library().has_vnni() else [0]


def ggml_isas() -> list[int]:
    """ggml_linear_dot's code paths this CPU runs: dot_isas() and, with AMX-INT8, 2."""
    return dot_isas() + ([2] if dot_available() and _library().has_amx() else [])


def int4_linear_dot(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int,
                    bits: int = 8, isa: int = 1) -> torch.Tensor:
    """As int4_linear, with x quantized to `bits` (ACTIVATION_BITS) blocks (`isa` 0 forces the AVX2 path)."""
    return _library().int4_linear_dot(x, codes, scale, offset, group, bits, isa)


def int8_linear_dot(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int, bits: int = 8,
                    isa: int = 1) -> torch.Tensor:
    return _library().int8_linear_dot(x, codes, scale, group, bits, isa)


PANEL = 8  # output rows one panel of the batched kernels interleaves (csrc/lowbit_panels.h)


def _panel_quads(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] → [P, K / 32, 8 quads, PANEL rows, 4]: per panel and block, each quad of 4 inputs of
    every row together (rows past N zero)."""
    n, k = codes.shape
    panels = -(-n // PANEL)
    padded = torch.nn.functional.pad(codes, (0, 0, 0, panels * PANEL - n))
    return padded.view(panels, PANEL, k // CHUNK, 8, 4).permute(0, 2, 3, 1, 4)


def _panel_scales(values: torch.Tensor, k: int, group: int, halves: int) -> torch.Tensor:
    """values [N, groups] → [P, K / 32, halves * PANEL * 4] bytes: per block, each of its `halves` parts'
    group value for the panel's rows."""
    n, blocks = values.shape[0], k // CHUNK
    panels = -(-n // PANEL)
    starts = torch.arange(blocks * halves) * (CHUNK // halves)
    v = torch.nn.functional.pad(values[:, starts // group].float(), (0, 0, 0, panels * PANEL - n))
    return v.view(panels, PANEL, blocks, halves).permute(0, 2, 3, 1).contiguous().view(torch.uint8).flatten(2)


def int4_panels(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    """INT4 codes [N, K / 2] (per 32-element chunk: element j in byte j's low nibble, j + 16 in its high
    one) with scale / offset [N, groups] → the batched kernel's panels [ceil(N / PANEL), K / 32, 192]:
    per panel and block, 4 vectors of 32 bytes whose byte 4c + t holds row c's element 4j + t (low
    nibble) and 4j + 16 + t (high), then the 8 rows' scales and offsets of the block's group."""
    n, k = codes.shape[0], codes.shape[1] * 2
    chunks = codes.view(n, -1, CHUNK // 2)
    quads = _panel_quads(torch.stack([chunks & 15, chunks >> 4], dim=2).view(n, k))
    packed = (quads[:, :, :4] | (quads[:, :, 4:] << 4)).flatten(2)
    return torch.cat([packed, _panel_scales(scale, k, group, 1), _panel_scales(offset, k, group, 1)], -1).contiguous()


def int8_panels(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """INT8 codes [N, K] with scale [N, groups] (groups of 16 too) → panels [ceil(N / PANEL), K / 32, 320]:
    per panel and block, 8 vectors of 32 bytes (byte 4c + t of vector q: row c's element 4q + t), then
    the rows' scales of elements 0-15 and of 16-31."""
    k = codes.shape[1]
    packed = _panel_quads(codes).flatten(2).view(torch.uint8)
    return torch.cat([packed, _panel_scales(scale, k, group, 2)], -1).contiguous()


def int4_gemm_dot(x: torch.Tensor, panels: torch.Tensor, n: int, bits: int = 8, isa: int = 1) -> torch.Tensor:
    """x [M, K] float32 contiguous (any M) @ the INT4 weight held as int4_panels → [M, n] float32, x
    quantized to `bits` blocks: the integer-dot row kernels' function, for many rows at once (`isa` 0
    forces the AVX2 path)."""
    return _library().int4_gemm_dot(x, panels, n, bits, isa)


def int8_gemm_dot(x: torch.Tensor, panels: torch.Tensor, n: int, bits: int = 8, isa: int = 1) -> torch.Tensor:
    """As int4_gemm_dot, for the INT8 weight held as int8_panels."""
    return _library().int8_gemm_dot(x, panels, n, bits, isa)


def quantize_activations(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 → (codes [M, K] as float, integers in [-L, L]; scales [M, K / 32]) with L =
    LEVELS[bits]: per block of 32, scale = max|x| / L and code = round-half-even(x * (L / max|x|)), the
    float32 arithmetic the kernel does."""
    levels = LEVELS[bits]
    blocks = x.view(x.shape[0], x.shape[1] // DOT_BLOCK, DOT_BLOCK)  # sizes spelled out: x may have no rows
    amax = blocks.abs().amax(-1)
    # a true float32 division as the kernel's (`levels / amax` on a tensor multiplies by its reciprocal,
    # which moves ties: at 16 bits one code in a few hundred lands on one)
    inv = torch.where(amax > 0, torch.full_like(amax, levels) / amax, torch.zeros_like(amax))
    return torch.round(blocks * inv[..., None]).flatten(1), amax / levels


def reference_dot_linear(x: torch.Tensor, weight_codes: torch.Tensor, scale: torch.Tensor,
                         offset: torch.Tensor | None, group: int, bits: int = 8) -> torch.Tensor:
    """What the integer-dot kernels compute, in float64: weight_codes [N, K] unpacked integer codes,
    scale / offset [N, groups]; the offset meets the sum of the quantized x over each group."""
    q, d = quantize_activations(x, bits)
    unit = min(group, DOT_BLOCK)  # INT8's half groups (16): two scales per activation block
    units = x.shape[1] // unit
    dots = torch.einsum("mbk,nbk->mnb", q.double().view(x.shape[0], units, unit),
                        weight_codes.double().view(weight_codes.shape[0], units, unit))
    unit_group = torch.arange(dots.shape[-1]) * unit // group
    d_unit = d.double().repeat_interleave(DOT_BLOCK // unit, dim=1)
    y = (dots * d_unit[:, None, :] * scale.double()[None, :, unit_group]).sum(-1)
    if offset is not None:
        group_sums = torch.zeros(x.shape[0], offset.shape[1], dtype=torch.float64)
        x_q = (q.double().view(x.shape[0], x.shape[1] // DOT_BLOCK, DOT_BLOCK) * d.double()[..., None]).flatten(1)
        group_sums.index_add_(1, torch.arange(x.shape[1]) // group, x_q)
        y += group_sums @ offset.double().T
    return y


# ---- the other layers' ops -----------------------------------------------------------------------------


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T in float32 (kernels/csrc/small_batch_linear.c)."""
    return _library().small_batch_linear(x, weight)


def paged_decode_attention(q: torch.Tensor, rows: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor,
                           scale: float, window: int | None, scales: torch.Tensor | None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """kernels/csrc/paged_attention.c: decode queries against a paged cache's rows (int8 ones with their scales),
    each head's sink logit (float32 [heads], if any) in its softmax's denominator."""
    return _library().paged_decode_attention(q, rows, block_tables, lens, scale, window, scales, sinks)


def rope_heads(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> None:
    """kernels/csrc/paged_attention.c: RoPE in place on the first `rotated` heads of heads [T, heads, D]."""
    _library().rope_heads(heads, cos, sin, rotated)


def rope_write_decode_attention(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                                slots: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, num_heads: int,
                                scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return _library().rope_write_decode_attention(heads, cos, sin, kv_cache, slots, block_tables, lens, num_heads,
                                                  scale, window, sinks)


def decode_step(x: torch.Tensor, kv_pool: torch.Tensor, kv_scales: torch.Tensor | None, descriptors: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                sizes: list[int], eps: float, scale: float, final_norm: torch.Tensor | None) -> None:
    """kernels/csrc/decode_step.c: every layer of a decode batch, in place (descriptors: csrc/abi.h's words)."""
    _library().decode_step(x, kv_pool, kv_scales, descriptors, cos, sin, slots, tables, lens, sizes, eps, scale,
                           final_norm)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One Gated DeltaNet decode token per row, on the pool's states state[slots] in place (kernels/csrc/gated_delta.c;
    layers/gated_delta.py's gated_delta_step is the reference)."""
    return _library().gated_delta_step(q, k, v, g, beta, state, slots)


def gated_delta_decode(proj: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, A_log: torch.Tensor,
                       dt_bias: torch.Tensor, norm_weight: torch.Tensor, conv_state: torch.Tensor, ssm: torch.Tensor,
                       slots: torch.Tensor, k_heads: int, eps: float, tiled: bool) -> torch.Tensor:
    """A Gated DeltaNet layer's mixer for decode rows, between in_proj and out_proj: proj [rows, qkv | z | b | a]
    → [rows, v_heads * v_dim], the conv and SSM states of the pool's slots updated in place (kernels/csrc/gated_delta.c;
    models/qwen3_5/model.py's layer-by-layer path is the reference)."""
    return _library().gated_delta_decode(proj, conv_weight, conv_bias, A_log, dt_bias, norm_weight, conv_state, ssm,
                                         slots, k_heads, eps, tiled)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each float32 row's argmax (kernels/csrc/greedy_argmax.c)."""
    return _library().greedy_argmax(logits)
