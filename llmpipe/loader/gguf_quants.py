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


def _five_bit_codes(high_bits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: 4 bytes of fifth bits (a little-endian uint32, bit j → weight j) and 16 bytes of
    nibbles → codes 0..31 uint8 [n, 32]."""
    high = _bit_planes(high_bits, bits=1, planes=8).transpose(1, 2).reshape(-1, 32)
    return unpack_nibbles(packed) | (high << 4)


def split_q5_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 [n, 22]: scale (f16), 32 fifth bits (uint32, bit j → weight j), 16 bytes of low nibbles
    → scale float16 [n, 1], signed codes q − 16 as int8 [n, 32] (value = d·(q − 16))."""
    q = _five_bit_codes(blocks[:, 2:6], blocks[:, 6:])
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


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1 [n, 24]: d, m (f16), 32 fifth bits (uint32), 16 bytes of low nibbles; value = d·q + m."""
    q = _five_bit_codes(blocks[:, 4:8], blocks[:, 8:])
    return q.float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


# IQ4_NL / IQ4_XS: a nibble indexes this non-linear codebook (ggml's kvalues_iq4nl).
IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8)


def split_iq4_nl(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_NL [n, 18]: d (f16), 16 bytes of nibbles (low ones first) → scale d float32 [n, 1],
    codebook values int8 [n, 32] (value = d·IQ4_VALUES[nibble])."""
    return _f16(blocks, 0), IQ4_VALUES[unpack_nibbles(blocks[:, 2:]).int()]


def dequantize_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    scale, q = split_iq4_nl(blocks)
    return q.float().mul_(scale)


# MXFP4: a nibble indexes FP4 E2M1's values doubled (ggml's kvalues_mxfp4), the block's scale halved to match.
MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes → float32 2^(e − 128), exactly (ggml's GGML_E8M0_TO_FP32_HALF; e < 2 a subnormal)."""
    e = e.int()
    return torch.where(e < 2, 0x00200000 << e.clamp(max=1), (e - 1) << 23).view(torch.float32)


def split_mxfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 [n, 17]: exponent e (E8M0), 16 bytes of nibbles (low ones first) → scale 2^(e − 128) float32
    [n, 1], codebook values int8 [n, 32] (value = scale·MXFP4_VALUES[nibble])."""
    return e8m0_half(blocks[:, :1]), MXFP4_VALUES[unpack_nibbles(blocks[:, 1:]).int()]


def dequantize_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    scale, q = split_mxfp4(blocks)
    return q.float().mul_(scale)


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Hugging Face's MXFP4 (gpt-oss's `*_blocks` uint8 [..., G, 16], `*_scales` uint8 [..., G]) → ggml MXFP4
    rows uint8 [..., G * 17]. HF's values are E2M1 · 2^(scale − 127), ggml's twice E2M1 · 2^(e − 128): codes and
    exponent carry over as they are; only the nibble order differs (HF byte j: elements 2j low, 2j + 1 high;
    ggml byte j: elements j low, j + 16 high)."""
    elements = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32] in weight order
    packed = elements[..., :16] | (elements[..., 16:] << 4)
    return torch.cat([scales.to(torch.uint8).unsqueeze(-1), packed], dim=-1).flatten(-2)


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
    return _scaled_sub_blocks(q, scale)


def _scaled_sub_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes [n, 256] times one float32 scale per sub-block, scale [n, sub-blocks] → float32 [n, 256]."""
    return q.float().reshape(*scale.shape, -1).mul_(scale.unsqueeze(-1)).reshape(-1, QK_K)


def _two_bit_quants(packed: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K: 64 bytes of 2-bit quants → [n, 16, 16]: 32-byte chunk c, bits 2p..2p+1, is
    weights 128c + 32p + j."""
    return _bit_planes(packed.reshape(-1, 32), bits=2, planes=4).reshape(-1, 16, 16)


def dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K [n, 84]: 16 bytes of 4-bit (scale, min) pairs (scale low), 64 bytes of 2-bit quants, d, dmin
    (f16); value = d·scale·q − dmin·min per 16-weight sub-block."""
    scales = blocks[:, :16]
    d = _f16(blocks, 80) * (scales & 0x0F).float()
    dm = _f16(blocks, 82) * (scales >> 4).float()
    return _two_bit_quants(blocks[:, 16:80]).float().mul_(d.unsqueeze(-1)).sub_(dm.unsqueeze(-1)).reshape(-1, QK_K)


def split_q3_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K [n, 110]: 32 bytes of high bits (bit p of byte j → weight 32p + j), 64 bytes of 2-bit quants,
    12 bytes of 6-bit scales (low nibbles in bytes 0-7, high 2 bits in 8-11), d (f16) → per 16-weight
    sub-block scale d·(scale − 32) float32 [n, 16], codes q − 4·(1 − high bit) in −4..3 int8 [n, 256]
    (value = scale·code)."""
    low = _bit_planes(blocks[:, 96:104], bits=4, planes=2).reshape(-1, 16)
    high = _bit_planes(blocks[:, 104:108], bits=2, planes=4).reshape(-1, 16)
    scale = _f16(blocks, 108) * ((low | (high << 4)).view(torch.int8) - 32).float()
    hmask = _bit_planes(blocks[:, :32], bits=1, planes=8).reshape(-1, 16, 16)
    q = _two_bit_quants(blocks[:, 32:96]).view(torch.int8) - ((hmask ^ 1) << 2).view(torch.int8)
    return scale, q.reshape(-1, QK_K)


def dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, q = split_q3_k(blocks)
    return _scaled_sub_blocks(q, scale)


def split_iq4_xs(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_XS [n, 136]: d (f16), the 6-bit scales' high 2 bits (uint16, bits 2i..2i+1 → sub-block i), their
    low nibbles (4 bytes, low nibble first), 8 × 16 bytes of nibbles (low ones first) → per 32-weight
    sub-block scale d·(scale − 32) float32 [n, 8], codebook values int8 [n, 256]."""
    low = _bit_planes(blocks[:, 4:8], bits=4, planes=2).transpose(1, 2).reshape(-1, 8)
    high = _bit_planes(blocks[:, 2:4], bits=2, planes=4).transpose(1, 2).reshape(-1, 8)
    scale = _f16(blocks, 0) * ((low | (high << 4)).view(torch.int8) - 32).float()
    nibbles = unpack_nibbles(blocks[:, 8:].reshape(-1, 8, 16)).reshape(-1, QK_K)
    return scale, IQ4_VALUES[nibbles.int()]


def dequantize_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    scale, q = split_iq4_xs(blocks)
    return _scaled_sub_blocks(q, scale)


BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: dequantize_q8_0,
    Q.Q4_0: dequantize_q4_0,
    Q.Q4_1: dequantize_q4_1,
    Q.Q5_0: dequantize_q5_0,
    Q.Q5_1: dequantize_q5_1,
    Q.Q2_K: dequantize_q2_k,
    Q.Q3_K: dequantize_q3_k,
    Q.Q4_K: dequantize_q4_k,
    Q.Q5_K: dequantize_q5_k,
    Q.Q6_K: dequantize_q6_k,
    Q.IQ4_NL: dequantize_iq4_nl,
    Q.IQ4_XS: dequantize_iq4_xs,
    Q.MXFP4: dequantize_mxfp4,
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
SUPPORTED_TYPES = frozenset((*FLOAT_TYPES, *BLOCK_DEQUANTIZERS))


def dequantize(data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor's data (float32/float16 elements, or raw bytes: F16's too) → a float tensor of `shape`.

    F32/F16/BF16 keep their dtype (the model casts); block formats become float32.
    """
    if qtype == Q.F32:
        return data.reshape(shape)
    if qtype == Q.F16:
        return data.view(torch.float16).reshape(shape)
    if qtype == Q.BF16:
        return data.view(torch.bfloat16).reshape(shape)
    _, type_size = GGML_QUANT_SIZES[qtype]
    return BLOCK_DEQUANTIZERS[qtype](data.reshape(-1, type_size)).reshape(shape)
