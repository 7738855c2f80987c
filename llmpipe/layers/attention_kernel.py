"""Decode attention in C (kernels/csrc/paged_attention.c), reading a float32 paged cache in place.

A decode step's attention in PyTorch is a gather of every cached block plus two dozen small ops
per layer (a bmm per KV head, softmax, stacking); at batch 1 those calls cost more than the
arithmetic. The kernel does the same float32 math in one call; `decode_attention` in
`attention.py` takes it where it applies and keeps the PyTorch path for other caches (bfloat16,
quantized). Both are tested against `reference_paged_attention`.
"""

from __future__ import annotations

import ctypes

import torch

from llmpipe.kernels.build import I64, PTR, KernelLibrary, kernel_op

_library = KernelLibrary(
    "paged_attention",
    paged_decode_attention=[PTR] * 5 + [I64] * 7 + [ctypes.c_float, I64],
    rope_write_decode_attention=[PTR] * 8 + [I64] * 7 + [ctypes.c_float, I64],
)


def usable(q: torch.Tensor, kv_cache) -> bool:
    """A float32 CPU cache (not a quantized one) and float32 queries, head_dim a multiple of 8."""
    return (
        isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.float32 and q.dtype == torch.float32
        and kv_cache.device.type == "cpu" and kv_cache.is_contiguous() and kv_cache.shape[-1] % 8 == 0
        and _library() is not None
    )


@kernel_op("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor lens, float scale, int? window) -> Tensor")
def paged_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, scale: float,
    window: int | None,
) -> torch.Tensor:
    """q [batch, heads, D] → [batch, heads × D]; kv_cache [2, blocks, block_size, kv_heads, D]."""
    batch, heads, head_dim = q.shape
    _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
    q, tables, lens = q.contiguous(), block_tables.to(torch.int64).contiguous(), lens.to(torch.int64).contiguous()
    out = torch.empty(batch, heads * head_dim)
    _library().paged_decode_attention(
        q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        batch, heads, kv_heads, head_dim, num_blocks, block_size, tables.shape[1], scale, window or 0,
    )
    return out


@kernel_op(
    "rope_write_decode_attention(Tensor(a!) heads, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slots, "
    "Tensor block_tables, Tensor lens, int num_heads, float scale, int? window) -> Tensor"
)
def rope_write_decode_attention(
    heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
    block_tables: torch.Tensor, lens: torch.Tensor, num_heads: int, scale: float, window: int | None,
) -> torch.Tensor:
    """A decode-only step's attention in one call: heads [B, H + 2 KVH, D] (the qkv projection,
    rotated in place), RoPE with cos / sin [B, 1, D], K/V written at `slots`, then the decode
    kernel → [B, H × D]. The same math as apply_rotary + write_kv + paged_decode_attention."""
    batch, _, head_dim = heads.shape
    _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
    out = torch.empty(batch, num_heads * head_dim)
    _library().rope_write_decode_attention(
        heads.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(), slots.data_ptr(),
        block_tables.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, num_heads, kv_heads, head_dim, num_blocks,
        block_size, block_tables.shape[1], scale, window or 0,
    )
    return out


def fused_decode_usable(heads: torch.Tensor, cos: torch.Tensor, kv_cache, meta) -> bool:
    """A decode-only batch (no prefill chunk, one row per sequence) on a float32 cache, with int64
    tables, contiguous float32 heads and rotary tables."""
    return (
        not meta.prefills and meta.num_decodes == heads.shape[0] and heads.is_contiguous() and cos.is_contiguous()
        and cos.dtype == torch.float32 and usable(heads, kv_cache) and meta.slot_mapping.dtype == torch.int64
        and meta.decode_block_tables.dtype == torch.int64 and meta.decode_block_tables.is_contiguous()
        and meta.decode_context_lens.dtype == torch.int64
    )
