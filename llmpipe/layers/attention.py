"""Causal self-attention over a sequence's KV cache.

The metadata says where this forward's tokens sit in the sequence; prefill and decode differ
only in it (many new tokens and an empty cache vs one new token and a long cached past).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    start_pos: int  # tokens already cached before this forward
    num_tokens: int  # new tokens in this forward

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens


def causal_mask(meta: AttentionMetadata, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [new tokens, cached + new] mask (True = may attend), or None where plain causal
    attention is exact: one new token, or a fresh prompt, with no window cutting in."""
    window_cuts = window is not None and meta.end_pos > window
    if not window_cuts and (meta.num_tokens == 1 or meta.start_pos == 0):
        return None
    query_pos = torch.arange(meta.start_pos, meta.end_pos, device=device)[:, None]
    key_pos = torch.arange(meta.end_pos, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, heads, D]; k, v: [T, kv_heads, D]; caches: [kv_heads, capacity, D]. Returns [T, heads × D].

    Writes the new K/V at positions start..end, then attends over everything cached so far.
    """
    start, end = meta.start_pos, meta.end_pos
    k_cache[:, start:end] = k.transpose(0, 1)
    v_cache[:, start:end] = v.transpose(0, 1)
    mask = causal_mask(meta, window, q.device)
    if meta.num_tokens == 1 and mask is None:
        return _single_query_attention(q[0], k_cache[:, :end], v_cache[:, :end], scale)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k_cache[:, :end].unsqueeze(0),
        v_cache[:, :end].unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None and meta.num_tokens > 1,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(meta.num_tokens, -1)


def _single_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode: one query per head against the cached keys, as two batched matmuls per KV head group.
    (PyTorch's CPU flash-attention kernel is several times slower for a single query.)"""
    kv_heads, _, head_dim = keys.shape
    grouped = q.view(kv_heads, -1, head_dim)  # query heads sharing a KV head sit next to each other
    probs = (torch.bmm(grouped, keys.transpose(1, 2)) * scale).softmax(dim=-1, dtype=torch.float32)
    return torch.bmm(probs.to(values.dtype), values).reshape(1, -1)
