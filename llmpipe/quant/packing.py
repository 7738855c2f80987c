"""The GPTQ and AWQ checkpoint layouts of 4-bit weights, to and from Int4Weight.

GPTQ, AutoGPTQ's "v1" format (`QuantLinear.pack` in auto_gptq/nn_modules/qlinear/qlinear_cuda.py):
  qweight int32 [in / 8, out]: input row i = 8r + j sits in bits 4j..4j+3 of qweight[r]
  qzeros  int32 [groups, out / 8]: zero − 1 of output o = 8c + j in bits 4j.. of qzeros[:, c]
  scales  float16 [groups, out]; g_idx int32 [in]: each input column's group (unsorted under act-order)
  w[o, i] = scales[g_idx[i], o] · (q[i, o] − zero[g_idx[i], o])
AWQ GEMM (`WQLinear_GEMM.from_linear` in awq/modules/linear/gemm.py, `dequantize_gemm` in
awq/utils/packing_utils.py):
  qweight int32 [in, out / 8]: output o = 8c + AWQ_ORDER[k] in bits 4k..4k+3 of qweight[:, c]
  qzeros  int32 [groups, out / 8] in the same order, zero stored as is; scales float16 [groups, out]
Both keep ceil(in / group_size) groups. AutoAWQ itself requires in % group_size == 0, so an AWQ
file with a partial last group (SmolLM2's 576 columns at g128) is an llmpipe extension.
"""

from __future__ import annotations

import torch

from llmpipe.quant.formats import Int4Weight

PACK = 8  # 4-bit values per int32
SHIFTS = torch.arange(0, 32, 4)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_int32(values: torch.Tensor) -> torch.Tensor:
    """[..., 8n] values 0..15 → int32 [..., n]: value j of each eight in bits 4j..4j+3."""
    packed = (values.long().unflatten(-1, (-1, PACK)) << SHIFTS).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] → int64 [..., 8n], the inverse of pack_int32."""
    return ((packed.long().unsqueeze(-1) >> SHIFTS) & 0xF).flatten(-2)


def integer_zeros(weight: Int4Weight) -> torch.Tensor:
    """The integer zero points [out, groups] behind offset = −zero · scale."""
    zero = -weight.offset / weight.scale
    rounded = zero.round()
    if not torch.allclose(zero, rounded, atol=1e-3) or rounded.min() < 0 or rounded.max() > 15:
        raise ValueError("offsets are not integer zero points in 0..15 (not a GPTQ/AWQ-style weight)")
    return rounded.long()


def group_index(in_features: int, group_size: int) -> torch.Tensor:
    return torch.arange(in_features) // group_size


def _awq_columns(out_features: int) -> torch.Tensor:
    """Packed column k of each eight holds output 8c + AWQ_ORDER[k]."""
    return (torch.arange(out_features).view(-1, PACK)[:, list(AWQ_ORDER)]).flatten()


def pack_gptq(weight: Int4Weight) -> dict[str, torch.Tensor]:
    zero = integer_zeros(weight)
    if zero.min() < 1:
        raise ValueError("zero point 0 cannot be stored in the GPTQ v1 layout (it writes zero − 1 in 4 bits)")
    q, g_idx = weight.q, group_index(weight.q.shape[1], weight.group_size)
    if weight.in_perm is not None:  # back to the original column order; g_idx tells the groups
        inverse = torch.argsort(weight.in_perm)
        q, g_idx = q[:, inverse], g_idx[inverse]
    return {
        "qweight": pack_int32(q).T.contiguous(),
        "qzeros": pack_int32(zero.T - 1),
        "scales": weight.scale.T.to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def unpack_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, group_size: int,
    zero_offset: int = 1,
) -> Int4Weight:
    """zero_offset: 1 for AutoGPTQ's v1 files (zero − 1 stored), 0 for GPTQModel's "gptq_v2"."""
    q = unpack_int32(qweight.T)  # [out, in]
    zero = (unpack_int32(qzeros) + zero_offset).T
    scale = scales.float().T.contiguous()
    in_perm = None
    expected = group_index(q.shape[1], group_size)
    if g_idx is not None and not torch.equal(g_idx.long(), expected):
        in_perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[in_perm], expected):
            raise ValueError(f"g_idx does not split the input columns into groups of {group_size}")
        q = q[:, in_perm]
    return Int4Weight(q.to(torch.uint8), scale, -zero * scale, group_size, in_perm)


def pack_awq(weight: Int4Weight) -> dict[str, torch.Tensor]:
    if weight.in_perm is not None:
        raise ValueError("the AWQ layout has no act-order (in_perm)")
    columns = _awq_columns(weight.q.shape[0])
    return {
        "qweight": pack_int32(weight.q.T[:, columns]),
        "qzeros": pack_int32(integer_zeros(weight).T[:, columns]),
        "scales": weight.scale.T.to(torch.float16).contiguous(),
    }


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Weight:
    order = torch.argsort(_awq_columns(qweight.shape[1] * PACK))
    q = unpack_int32(qweight)[:, order].T
    zero = unpack_int32(qzeros)[:, order].T
    scale = scales.float().T.contiguous()
    return Int4Weight(q.to(torch.uint8).contiguous(), scale, -zero * scale, group_size)
