"""A quantized layer of the paged KV cache: K and V as int8 or packed int4, dequantized on read.

int8: symmetric, one float16 scale per token and KV head. int4: asymmetric, a float16 scale and
minimum per group of KV_INT4_GROUP head-dim elements, two codes per byte (element 2i in the low
nibble, 2i + 1 in the high one). Attention reads whole blocks, so reads dequantize whole blocks.

int4 K and V are stored rotated by an orthonormal Hadamard matrix R (as QuaRot does): a few
head-dim channels of RoPE'd keys carry most of the magnitude, and rotating spreads them over the
whole vector, so each group's min-max range, and its rounding step, shrinks (SmolLM2 on Hamlet:
+3.1% perplexity over the float cache rotated, +5.3% not). q·k = (qR)·(kR) and p·V = (p·VR)Rᵀ,
so attention rotates the queries and un-rotates its output (`rotation`): two small matmuls per
layer instead of un-rotating every cached vector it reads.
"""

from __future__ import annotations

import functools
import math

import torch

from llmpipe.kernels import huge_pages

KV_INT4_GROUP = 32  # int4 KV: one scale and one minimum per this many head-dim elements
SCALE_DTYPE = torch.float16


@functools.cache
def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order n (a power of two): entries ±1/√n."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    return h / math.sqrt(n)


class QuantizedKV:
    """One layer's storage: codes [2, blocks, block_size, kv_heads, D or D / 2] plus scales.

    `rotation` (int4, D a power of two): K and V are stored as K·R and V·R, and `read` returns them so."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, head_dim: int):
        self.codes, self.scale, self.minimum, self.head_dim = codes, scale, minimum, head_dim
        rotated = minimum is not None and head_dim & (head_dim - 1) == 0
        self.rotation = hadamard(head_dim).to(codes.device) if rotated else None

    @staticmethod
    def storage(kind: str, shape: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Zeroed (codes, scale, minimum) for a float cache of `shape` [..., head_dim]."""
        *lead, head_dim = shape
        if kind == "int8":
            return (huge_pages.zeros((*lead, head_dim), torch.int8, device),
                    huge_pages.zeros((*lead, 1), SCALE_DTYPE, device), None)
        groups = -(-head_dim // KV_INT4_GROUP)
        return (huge_pages.zeros((*lead, head_dim // 2), torch.uint8, device),
                huge_pages.zeros((*lead, groups), SCALE_DTYPE, device),
                huge_pages.zeros((*lead, groups), SCALE_DTYPE, device))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.head_dim))

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, D] → the cache slots `slots` (block × block_size + offset)."""
        x = torch.stack([k, v]).float()
        codes, scale, minimum = self.quantize(x if self.rotation is None else x @ self.rotation)
        for store, new in ((self.codes, codes), (self.scale, scale), (self.minimum, minimum)):
            if store is not None:
                store.flatten(1, 2).index_copy_(1, slots, new)

    def read(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks `block_ids` dequantized: [2, len(block_ids), block_size, kv_heads, D] (rotated by `rotation`)."""
        codes, scale = self.codes.index_select(1, block_ids), self.scale.index_select(1, block_ids).float()
        if self.minimum is None:
            return (codes.float() * scale).to(dtype)
        minimum = self.minimum.index_select(1, block_ids).float()
        values = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).float()
        grouped = values.unflatten(-1, (-1, min(KV_INT4_GROUP, self.head_dim)))
        return (grouped * scale[..., None] + minimum[..., None]).flatten(-2).to(dtype)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.minimum is None:
            scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-8).to(SCALE_DTYPE)
            return (x / scale.float()).round().clamp(-127, 127).to(torch.int8), scale, None
        groups = x.unflatten(-1, (-1, min(KV_INT4_GROUP, self.head_dim)))
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        minimum = lo.to(SCALE_DTYPE)
        scale = ((hi - minimum.float()) / 15).clamp(min=1e-8).to(SCALE_DTYPE)
        q = ((groups - minimum.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 15).to(torch.uint8)
        q = q.flatten(-2)
        return q[..., 0::2] | (q[..., 1::2] << 4), scale, minimum
