"""Fake (meta) implementations of the ops `csrc/ops.cpp` defines: their outputs' shapes and dtypes, so
torch.compile and FakeTensorMode trace each op as one opaque call. ops.cpp names this module
(`set_python_module`), and torch requires the fakes of C++ ops to be registered from the module named.
`has_vnni` takes no tensors and needs none.
"""

from __future__ import annotations

import torch

from llmpipe.quant.formats import Q5_0_BLOCK, Q5_0_BLOCK_BYTES


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


@torch.library.register_fake("llmpipe::int4_linear")
def int4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                group: int) -> torch.Tensor:
    return _rows(x, codes.shape[0])


@torch.library.register_fake("llmpipe::int8_linear")
def int8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return _rows(x, codes.shape[0])


@torch.library.register_fake("llmpipe::int4_dequantize")
def int4_dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    return codes.new_empty(codes.shape[0], 2 * codes.shape[1], dtype=torch.float32)


@torch.library.register_fake("llmpipe::int8_dequantize")
def int8_dequantize(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return codes.new_empty(codes.shape, dtype=torch.float32)


@torch.library.register_fake("llmpipe::int4_linear_dot")
def int4_linear_dot(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int,
                    bits: int = 8, isa: int = 1) -> torch.Tensor:
    return _rows(x, codes.shape[0])


@torch.library.register_fake("llmpipe::int8_linear_dot")
def int8_linear_dot(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int, bits: int = 8,
                    isa: int = 1) -> torch.Tensor:
    return _rows(x, codes.shape[0])


@torch.library.register_fake("llmpipe::q5_0_linear")
def q5_0_linear(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    return _rows(x, blocks.shape[0])


@torch.library.register_fake("llmpipe::q5_0_linear_dot")
def q5_0_linear_dot(x: torch.Tensor, blocks: torch.Tensor, bits: int = 8, isa: int = 1) -> torch.Tensor:
    return _rows(x, blocks.shape[0])


@torch.library.register_fake("llmpipe::ggml_linear_dot")
def ggml_linear_dot(x: torch.Tensor, blocks: torch.Tensor, type: int, bits: int = 16, isa: int = 2) -> torch.Tensor:
    return _rows(x, blocks.shape[0])


@torch.library.register_fake("llmpipe::ggml_segments_dot")
def ggml_segments_dot(x: torch.Tensor, table: torch.Tensor, N: int, bits: int = 16, isa: int = 2) -> torch.Tensor:
    return _rows(x, N)


@torch.library.register_fake("llmpipe::q5_0_unpack")
def q5_0_unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = blocks.shape[1] // Q5_0_BLOCK_BYTES * Q5_0_BLOCK
    return (blocks.new_empty(blocks.shape[0], k, dtype=torch.int8),
            blocks.new_empty(blocks.shape[0], k // Q5_0_BLOCK, dtype=torch.float32))


@torch.library.register_fake("llmpipe::int4_gemm_dot")
def int4_gemm_dot(x: torch.Tensor, panels: torch.Tensor, N: int, bits: int = 8, isa: int = 1) -> torch.Tensor:
    return _rows(x, N)


@torch.library.register_fake("llmpipe::int8_gemm_dot")
def int8_gemm_dot(x: torch.Tensor, panels: torch.Tensor, N: int, bits: int = 8, isa: int = 1) -> torch.Tensor:
    return _rows(x, N)


@torch.library.register_fake("llmpipe::gated_delta_step")
def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return v.new_empty(v.shape, dtype=torch.float32)


@torch.library.register_fake("llmpipe::gated_delta_decode")
def gated_delta_decode(proj: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, A_log: torch.Tensor,
                       dt_bias: torch.Tensor, norm_weight: torch.Tensor, conv_state: torch.Tensor, ssm: torch.Tensor,
                       slots: torch.Tensor, k_heads: int, eps: float, tiled: bool) -> torch.Tensor:
    return proj.new_empty(proj.shape[0], ssm.shape[1] * ssm.shape[3], dtype=torch.float32)


@torch.library.register_fake("llmpipe::greedy_argmax")
def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@torch.library.register_fake("llmpipe::small_batch_linear")
def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _rows(x, weight.shape[0])


@torch.library.register_fake("llmpipe::paged_decode_attention")
def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor,
                           scale: float, window: int | None, kv_scales: torch.Tensor | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    return _rows(q, q.shape[1] * q.shape[2])


@torch.library.register_fake("llmpipe::rope_heads")
def rope_heads(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> None:
    return None  # rotates heads in place


@torch.library.register_fake("llmpipe::rope_write_decode_attention")
def rope_write_decode_attention(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                                slots: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, num_heads: int,
                                scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return _rows(heads, num_heads * heads.shape[2])


@torch.library.register_fake("llmpipe::decode_step")
def decode_step(x: torch.Tensor, kv_pool: torch.Tensor, kv_scales: torch.Tensor | None, descriptors: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                sizes: list[int], eps: float, scale: float, final_norm: torch.Tensor | None = None) -> None:
    return None  # writes x and the cache in place
