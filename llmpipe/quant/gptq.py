"""GPTQ (Frantar et al., 2022): quantize a weight one input column at a time, spreading each
column's rounding error over the columns not yet quantized, weighted by the inverse Hessian of
the layer's reconstruction loss, H = 2 XᵀX over calibration inputs X.

Follows the reference implementation (IST-DASLab/gptq `GPTQ.fasterquant`, as in AutoGPTQ):
dampening by percdamp · mean(diag H), the upper Cholesky factor of H⁻¹, lazy batch updates in
blocks of columns, group-wise asymmetric scales found when a group starts (from the already
error-compensated weights), and optional act-order (columns in order of decreasing diag H).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from llmpipe.quant.calibrate import Attend, LayerQuantizer, RunLayer, linear_modules
from llmpipe.quant.formats import Int4Weight
from llmpipe.quant.rtn import int4_codes, int4_scale_zero


class Hessian:
    """Accumulates H = 2/n Σ xxᵀ over the rows x of a linear layer's inputs."""

    def __init__(self, in_features: int):
        self.sum = torch.zeros(in_features, in_features)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.sum.addmm_(x.T, x)
        self.rows += x.shape[0]

    def value(self) -> torch.Tensor:
        return self.sum * (2 / max(self.rows, 1))


def inverse_hessian_factor(hessian: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + λI)⁻¹ (= UᵀU), λ = percdamp · mean(diag H)."""
    h = hessian.clone()
    h.diagonal().add_(percdamp * h.diagonal().mean())
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    percdamp: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
    min_zero: int = 1,
) -> Int4Weight:
    """Float [out, in] weight and its [in, in] Hessian → INT4 with group-wise scales.

    With act_order the result's columns (and groups) follow the permutation, kept in `in_perm`.
    min_zero=1 keeps zero points storable in the AutoGPTQ layout (see rtn.int4_scale_zero).
    """
    w = weight.detach().float().clone()
    h = hessian.float().clone()
    out_features, in_features = w.shape
    dead = h.diagonal() == 0  # inputs that were always zero: their weights cannot matter
    h.diagonal()[dead] = 1
    w[:, dead] = 0
    perm = None
    if act_order:
        perm = torch.argsort(h.diagonal(), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    groups = -(-in_features // group_size)
    q = torch.zeros(out_features, in_features, dtype=torch.uint8)
    scale = torch.zeros(out_features, groups)
    zero = torch.zeros(out_features, groups)
    block_size = max(block_size // group_size, 1) * group_size  # groups never straddle blocks
    with _one_thread():
        u = inverse_hessian_factor(h, percdamp)
        for start in range(0, in_features, block_size):
            _quantize_block(w, u, q, scale, zero, start, min(start + block_size, in_features), group_size, min_zero)
    return Int4Weight(q, scale, -zero * scale, group_size, perm)


def _quantize_block(w, u, q, scale, zero, start: int, end: int, group_size: int, min_zero: int) -> None:
    """Columns start..end one by one, each error spread over the block's later columns at once;
    then the block's errors over every later column in one matmul (the "lazy batch" update)."""
    block = w[:, start:end].clone()
    errors = torch.zeros_like(block)
    u_block = u[start:end, start:end]
    for i in range(end - start):
        column = start + i
        g = column // group_size
        if column % group_size == 0:
            scale[:, g], zero[:, g] = int4_scale_zero(block[:, i : i + group_size], min_zero)
        codes = int4_codes(block[:, i], scale[:, g], zero[:, g])
        q[:, column] = codes.to(torch.uint8)
        error = (block[:, i] - (codes - zero[:, g]) * scale[:, g]) / u_block[i, i]
        block[:, i:].sub_(error[:, None] * u_block[i, i:][None, :])
        errors[:, i] = error
    w[:, end:].sub_(errors @ u[start:end, end:])


@contextmanager
def _one_thread():
    """The column loop is thousands of tiny ops, and the Cholesky factorizations are small: waking a
    thread pool for each costs more than the work (5-15x slower with 2 threads on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def gptq_layer_quantizer(group_size: int, act_order: bool = False, percdamp: float = 0.01) -> LayerQuantizer:
    """Every linear of a decoder layer from one pass of Hessians over the calibration samples
    (stacked q/k/v and gate/up share an input, so one Hessian serves each stack)."""

    def quantize(layer: nn.Module, run: RunLayer, _attend: Attend) -> dict[str, Int4Weight]:
        linears = linear_modules(layer)
        hessians = {name: Hessian(module.in_features) for name, module in linears.items()}
        run(lambda name, x: hessians[name].add(x))
        out = {}
        for name, module in linears.items():
            out[name] = gptq_quantize(module.weight, hessians[name].value(), group_size, percdamp, act_order)
            module.weight.copy_(out[name].dequantize())
        return out

    return quantize
