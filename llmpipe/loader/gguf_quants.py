"""Dequantize ggml tensor types in torch, vectorised over whole tensors (no loop over blocks).

A quantized GGUF tensor is raw bytes: rows of fixed-size blocks, each holding a few scales and
packed integers for `block_size` weights. `split_*` cut a [n_blocks, type_size] byte tensor into
those fields (the form int8/int4 kernels repack from); `dequantize_*` rebuild float32 weights
with the arithmetic order of ggml and `gguf.quants`, so results match them bit for bit; the
float work is done in place on one buffer per tensor (allocation dominates otherwise).
"""

from __future__ import annotations

from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # weights per super-block of the K-quants
Q = GGMLQuantizationType


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, offset : offset + 2].view(torch.float16).float()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes → [..., 2k] values 0..15: all low nibbles, then all high ones (ggml order)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _bit_planes(packed: torch.Tensor, bits: int, planes: int) -> torch.Tensor:
    """[n, m] bytes → [n, planes, m]: plane p holds bits [p·bits, (p+1)·bits) of every byte."""
    shifts = torch.arange(0, bits * planes, bits, dtype=torch.uint8).view(1, planes, 1)
    return (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)


# --- 32-weight blocks -------------------------------------------------------------------------


def split_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 [n, 34] → scale float16 [n, 1], weights int8 [n, 32]."""
    return blocks[:, :2].view(torch.float16), blocks[:, 2:].view(torch.int8)


def split_q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 [n, 18] → scale float16 [n, 1], packed nibbles uint8 [n, 16] (value = d·(q − 8))."""
    return blocks[:, :2].view(torch.float16), blocks[:, 2:]


def split_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 [n, 20] → scale, min float16 [n, 1], packed nibbles uint8 [n, 16] (value = d·q + m)."""
    return blocks[:, :2].view(torch.float16), blocks[:, 2:4].view(torch.float16), blocks[:, 4:]


def split_q5_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 [n, 22]: scale (f16), 32 fifth bits (uint32, bit j → weight j), 16 bytes of low nibbles
    → scale float16 [n, 1], signed codes q − 16 as int8 [n, 32] (value = d·(q − 16))."""
    high = _bit_planes(blocks[:, 2:6], bits=1, planes=8).transpose(1, 2).reshape(-1, 32)
    q = unpack_nibbles(blocks[:, 6:]) | (high << 4)
    return blocks[:, :2].view(torch.float16), q.view(torch.int8) - 16


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    scale, q = split_q5_0(blocks)
    return q.float().mul_(scale.float())


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    scale, q = split_q8_0(blocks)
    return q.float().mul_(scale.float())


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    scale, packed = split_q4_0(blocks)
    return unpack_nibbles(packed).float().sub_(8).mul_(scale.float())


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    scale, minimum, packed = split_q4_1(blocks)
    return unpack_nibbles(packed).float().mul_(scale.float()).add_(minimum.float())


# --- K-quants: 256-weight super-blocks of 8 or 16 sub-blocks ------------------------------------


def k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of Q4_K/Q5_K scales → eight 6-bit scales and eight 6-bit mins, each [n, 8]."""
    d, m, md = packed.reshape(-1, 3, 4).unbind(dim=1)
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales, mins


def _k_sub_block_affine(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: each 32-weight sub-block's scale d·scale and min dmin·min, float32 [n, 8]."""
    scales, mins = k_scales_mins(blocks[:, 4:16])
    return _f16(blocks, 0) * scales.float(), _f16(blocks, 2) * mins.float()


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: weight = d·scale·q − dmin·min per 32-weight sub-block; q is [n, 8, 32]."""
    d, dm = _k_sub_block_affine(blocks)
    return q.float().mul_(d.unsqueeze(-1)).sub_(dm.unsqueeze(-1)).reshape(-1, QK_K)


def _k_low_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """128 bytes of 4-bit quants → [n, 8, 32]: 32-byte chunk c gives sub-blocks 2c (low), 2c+1 (high)."""
    return unpack_nibbles(packed.reshape(-1, 4, 32)).reshape(-1, 8, 32)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K [n, 144]: d, dmin (f16), 12 bytes of scales/mins, 128 bytes of nibbles."""
    return _k_affine(blocks, _k_low_nibbles(blocks[:, 16:]))


def split_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K [n, 144] → per 32-weight sub-block scale and offset float32 [n, 8] (offset = −dmin·min),
    codes 0..15 uint8 [n, 256] in weight order: value = scale·q + offset, as dequantize_q4_k's."""
    d, dm = _k_sub_block_affine(blocks)
    return d, dm.neg_(), _k_low_nibbles(blocks[:, 16:]).reshape(-1, QK_K)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K [n, 176]: as Q4_K, plus 32 bytes whose bit j is the fifth bit of sub-block j."""
    high = _bit_planes(blocks[:, 16:48], bits=1, planes=8)
    return _k_affine(blocks, _k_low_nibbles(blocks[:, 48:]) | (high << 4))


def split_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K [n, 210]: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d (f16) →
    per 16-weight sub-block scale d·scale float32 [n, 16], signed codes q − 32 int8 [n, 256] in weight
    order (value = scale·(q − 32))."""
    low = unpack_nibbles(blocks[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    high = _bit_planes(blocks[:, 128:192].reshape(-1, 32), bits=2, planes=4).reshape(-1, 8, 32)
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()
    return scale, ((low | (high << 4)).view(torch.int8) - 32).reshape(-1, QK_K)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, q = split_q6_k(blocks)
    return q.float().reshape(-1, 16, 16).mul_(scale.unsqueeze(-1)).reshape(-1, QK_K)


BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: dequantize_q8_0,
    Q.Q4_0: dequantize_q4_0,
    Q.Q4_1: dequantize_q4_1,
    Q.Q5_0: dequantize_q5_0,
    Q.Q4_K: dequantize_q4_k,
    Q.Q5_K: dequantize_q5_k,
    Q.Q6_K: dequantize_q6_k,
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
SUPPORTED_TYPES = frozenset((*FLOAT_TYPES, *BLOCK_DEQUANTIZERS))


def dequantize(data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor's data (float32/float16 elements, or raw bytes) → a float tensor of `shape`.

    F32/F16/BF16 keep their dtype (the model casts); block formats become float32.
    """
    if qtype in (Q.F32, Q.F16):
        return data.reshape(shape)
    if qtype == Q.BF16:
        return data.view(torch.bfloat16).reshape(shape)
    _, type_size = GGML_QUANT_SIZES[qtype]
    return BLOCK_DEQUANTIZERS[qtype](data.reshape(-1, type_size)).reshape(shape)
