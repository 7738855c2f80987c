"""GPTQ against round-to-nearest and against the paper's column-by-column definition."""

import pytest
import torch

from llmpipe.quant.gptq import Hessian, gptq_quantize
from llmpipe.quant.rtn import quantize_int4


def correlated_inputs(rows=1024, dim=64, seed=0) -> torch.Tensor:
    """Inputs with strongly correlated channels of uneven size, like a transformer's activations."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=gen) / dim**0.5
    channel_scale = torch.linspace(0.2, 3.0, dim)[torch.randperm(dim, generator=gen)]
    return (torch.randn(rows, dim, generator=gen) @ mix) * channel_scale


def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return (x @ (w_hat - w).T).pow(2).mean().item()


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    h = Hessian(x.shape[1])
    for chunk in x.split(100):  # accumulating in pieces equals one product
        h.add(chunk)
    return h.value()


def test_hessian_is_two_x_transpose_x_over_rows():
    x = correlated_inputs(rows=300)
    torch.testing.assert_close(hessian_of(x), 2 * x.T @ x / 300, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act_order", [False, True], ids=["static groups", "act-order"])
def test_gptq_output_error_is_well_below_round_to_nearest(act_order):
    x = correlated_inputs()
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 0.1
    gptq = gptq_quantize(w, hessian_of(x), group_size=16, act_order=act_order)
    rtn = quantize_int4(w, 16, min_zero=1)
    assert output_error(x, w, gptq.dequantize()) < 0.7 * output_error(x, w, rtn.dequantize())
    if act_order:  # columns in order of decreasing Hessian diagonal, groups contiguous in that order
        diag = hessian_of(x).diagonal()
        assert torch.equal(gptq.in_perm, torch.argsort(diag, descending=True))


def test_with_an_identity_hessian_gptq_is_round_to_nearest():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    gptq = gptq_quantize(w, torch.eye(64), group_size=16)
    rtn = quantize_int4(w, 16, min_zero=1)
    assert torch.equal(gptq.q, rtn.q)
    torch.testing.assert_close(gptq.dequantize(), rtn.dequantize())


def reference_gptq(w: torch.Tensor, hessian: torch.Tensor, group_size: int, percdamp: float) -> torch.Tensor:
    """The optimal-brain-quantizer recursion GPTQ computes, one column at a time in float64: quantize
    column i, spread its error over the later columns through H⁻¹, then remove i from H⁻¹."""
    w = w.double().clone()
    h = hessian.double() + percdamp * hessian.diagonal().mean().double() * torch.eye(hessian.shape[0], dtype=torch.float64)
    h_inv = torch.linalg.inv(h)
    out = torch.empty_like(w)
    for i in range(w.shape[1]):
        if i % group_size == 0:
            group = w[:, i : i + group_size]
            lo, hi = group.amin(1), group.amax(1)
            scale = (hi - lo).clamp(min=1e-5) / 15
            zero = (-lo / scale).round().clamp(1, 15)
        q = ((w[:, i] / scale).round() + zero).clamp(0, 15)
        out[:, i] = (q - zero) * scale
        error = (w[:, i] - out[:, i]) / h_inv[i, i]
        w[:, i + 1 :] -= error[:, None] * h_inv[i, i + 1 :][None, :]
        h_inv = h_inv - torch.outer(h_inv[:, i], h_inv[i, :]) / h_inv[i, i]
    return out.float()


def test_blocked_cholesky_gptq_matches_the_column_by_column_definition():
    x = correlated_inputs(rows=512, dim=48, seed=3)
    w = torch.randn(24, 48, generator=torch.Generator().manual_seed(4)) * 0.1
    h = hessian_of(x)
    ours = gptq_quantize(w, h, group_size=16, block_size=32).dequantize()
    reference = reference_gptq(w, h, 16, 0.01)
    same = (ours - reference).abs() < 1e-4
    assert same.float().mean() > 0.97  # a rare rounding tie may flip, and its error feedback differ
    assert output_error(x, w, ours) == pytest.approx(output_error(x, w, reference), rel=0.05)
