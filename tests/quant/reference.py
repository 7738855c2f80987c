"""Dequantizing GPTQ / AWQ tensors straight from the layouts' definitions, one input column at a
time (AutoGPTQ's `QuantLinear` v1 format, AutoAWQ's `WQLinear_GEMM`), independent of llmpipe's code."""

from __future__ import annotations

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def nibbles(words: torch.Tensor, k: torch.Tensor | int) -> torch.Tensor:
    return ((words.long() & 0xFFFFFFFF) >> (4 * k)) & 0xF


def reference_gptq_weight(qweight, qzeros, scales, g_idx) -> torch.Tensor:
    """w[o, i] = scales[g, o] · (q[i, o] − (z[g, o] + 1)), g = g_idx[i]; q[i, o] is nibble i mod 8 of
    qweight[i // 8, o], z[g, o] nibble o mod 8 of qzeros[g, o // 8]."""
    out_features, o = scales.shape[1], torch.arange(scales.shape[1])
    w = torch.empty(out_features, g_idx.numel())
    for i in range(g_idx.numel()):
        g = int(g_idx[i])
        q = nibbles(qweight[i // 8], i % 8)
        z = nibbles(qzeros[g, o // 8], o % 8) + 1
        w[:, i] = scales[g].float() * (q - z)
    return w


def reference_awq_weight(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """w[o, i] = scales[i // g, o] · (q − z): output o sits at nibble AWQ_ORDER.index(o mod 8) of
    column o // 8 of qweight[i] (and of qzeros[i // g])."""
    out_features, o = scales.shape[1], torch.arange(scales.shape[1])
    k = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])[o % 8]
    w = torch.empty(out_features, qweight.shape[0])
    for i in range(qweight.shape[0]):
        g = i // group_size
        w[:, i] = scales[g].float() * (nibbles(qweight[i, o // 8], k) - nibbles(qzeros[g, o // 8], k))
    return w
