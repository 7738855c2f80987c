"""Decode attention in C (kernels/csrc/paged_attention.c), reading a float32 or int8 paged cache in place.

A decode step's attention in PyTorch is a gather of every cached block (for a quantized cache, each
dequantized) plus two dozen small ops per layer (a bmm per KV head, softmax, stacking); at batch 1
those calls cost more than the arithmetic. The kernel does the same float32 math in one call, on int8
codes dequantized as `QuantizedKV.read` does; `decode_attention` in `attention.py` takes it where it
applies and keeps the PyTorch path for other caches (bfloat16, int4). Both are tested against
`reference_paged_attention`.
"""

from __future__ import annotations

import torch

from llmpipe.kernels import ops
from llmpipe.quant.kv import QuantizedKV


def cache_tensors(kv_cache) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """What the C kernels read of a layer's cache: (float32 rows, None) or (int8 codes, float16 scales),
    contiguous CPU tensors, head_dim a multiple of 8 — or None for any other cache (bfloat16, int4)."""
    if isinstance(kv_cache, QuantizedKV):
        if kv_cache.minimum is not None or kv_cache.codes.dtype != torch.int8:  # int4: rotated groups
            return None
        tensors = (kv_cache.codes, kv_cache.scale)
    elif isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.float32:
        tensors = (kv_cache, None)
    else:
        return None
    present = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in present) or tensors[0].shape[-1] % 8:
        return None
    return tensors


def usable(q: torch.Tensor, kv_cache) -> bool:
    """A cache the kernels read (cache_tensors) and float32 queries."""
    return q.dtype == torch.float32 and cache_tensors(kv_cache) is not None and ops.available()


def paged_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKV, block_tables: torch.Tensor, lens: torch.Tensor, scale: float,
    window: int | None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [batch, heads, D] → [batch, heads × D]; kv_cache [2, blocks, block_size, kv_heads, D] (float32, or
    an int8 QuantizedKV); the tables and lengths of any integer type; sinks [heads] (any float dtype) or None."""
    rows, scales = cache_tensors(kv_cache)
    return ops.paged_decode_attention(q, rows, block_tables, lens, scale, window, scales, _float32(sinks))


def rope_write_decode_attention(
    heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
    block_tables: torch.Tensor, lens: torch.Tensor, num_heads: int, scale: float, window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decode-only step's attention in one call: heads [B, H + 2 KVH, D] (the qkv projection,
    rotated in place), RoPE with cos / sin [B, 1, D], K/V written at `slots`, then the decode
    kernel → [B, H × D]. The same math as apply_rotary + write_kv + paged_decode_attention."""
    return ops.rope_write_decode_attention(
        heads, cos, sin, kv_cache, slots, block_tables, lens, num_heads, scale, window, _float32(sinks))


def _float32(sinks: torch.Tensor | None) -> torch.Tensor | None:
    return None if sinks is None else sinks.detach().float().contiguous()


def fused_decode_usable(heads: torch.Tensor, cos: torch.Tensor, kv_cache, meta) -> bool:
    """A decode-only batch (no prefill chunk, one row per sequence) on a float32 cache, with int64
    tables, contiguous float32 heads and rotary tables."""
    return (
        not meta.prefills and meta.num_decodes == heads.shape[0] and heads.is_contiguous() and cos.is_contiguous()
        and cos.dtype == torch.float32 and isinstance(kv_cache, torch.Tensor) and usable(heads, kv_cache)
        and meta.slot_mapping.dtype == torch.int64
        and meta.decode_block_tables.dtype == torch.int64 and meta.decode_block_tables.is_contiguous()
        and meta.decode_context_lens.dtype == torch.int64
    )
