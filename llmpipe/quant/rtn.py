"""Round-to-nearest quantizers: the reference every other method is measured against.

INT4 is asymmetric min/max per group of `group_size` input columns with an integer zero point
(AutoAWQ's `pseudo_quantize_tensor`), so the same codes also export to the GPTQ / AWQ layouts.
A last group narrower than `group_size` (in_features not a multiple of it) is allowed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmpipe.quant.formats import Int4Weight, Int8Weight

INT4_MAX = 15


def pad_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] → [out, ceil(in / g), g]; a partial last group is padded with copies of its last
    column, which leaves its min and max unchanged."""
    pad = -w.shape[1] % group_size
    if pad:
        w = F.pad(w[None], (0, pad), mode="replicate")[0]
    return w.unflatten(1, (-1, group_size))


def int4_scale_zero(w: torch.Tensor, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max over the last dimension of w → (scale, integer zero point), both float.

    min_zero=1 keeps zero points storable in AutoGPTQ's format, which writes zero − 1 in 4 bits.
    """
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = (hi - lo).clamp(min=1e-5) / INT4_MAX
    zero = (-lo / scale).round().clamp(min_zero, INT4_MAX)
    return scale, zero


def int4_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q = clamp(round(w / scale) + zero, 0, 15); scale and zero broadcast against w."""
    return ((w / scale).round() + zero).clamp(0, INT4_MAX)


def quantize_int4(w: torch.Tensor, group_size: int, min_zero: int = 0) -> Int4Weight:
    """Float [out, in] → group-wise asymmetric INT4."""
    in_features = w.shape[1]
    groups = pad_groups(w.float(), group_size)
    scale, zero = int4_scale_zero(groups, min_zero)
    q = int4_codes(groups, scale[..., None], zero[..., None]).flatten(1)[:, :in_features]
    return Int4Weight(q.to(torch.uint8), scale, -zero * scale, group_size)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Float [out, in] → symmetric INT8 per output row (scale = max|w| / 127)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
    q = (w / scale[:, None]).round().clamp(-127, 127)
    return Int8Weight(q.to(torch.int8), scale)
