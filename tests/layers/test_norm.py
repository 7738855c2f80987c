"""RMSNorm against Hugging Face's LlamaRMSNorm arithmetic, for the fused float32 path and the spelled-out one."""

import pytest
import torch

from llmpipe.layers.norm import RMSNorm


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_matches_the_reference_bit_for_bit(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data = (torch.randn(96, generator=gen) * 2).to(dtype)
    x = (torch.randn(rows, 96, generator=gen) * 5).to(dtype)
    assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-6))


def hf_gemma3_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm.forward: (1 + weight) in float32, one cast at the end."""
    output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (output * (1.0 + weight.float())).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 256), (7, 4, 256), (300, 640)])
def test_unit_offset_rms_norm_matches_gemmas_bit_for_bit_and_follows_weight_updates(dtype, shape):
    gen = torch.Generator().manual_seed(shape[0])
    norm = RMSNorm(shape[-1], 1e-6, unit_offset=True).to(dtype)
    norm.weight.data = (torch.randn(shape[-1], generator=gen) * 2).to(dtype)
    x = (torch.randn(*shape, generator=gen) * 5).to(dtype)
    assert torch.equal(norm(x), hf_gemma3_rms_norm(x, norm.weight, 1e-6))
    with torch.no_grad():
        norm.weight.mul_(-3)  # in place, after a forward: the cached 1 + weight must not go stale
    assert torch.equal(norm(x), hf_gemma3_rms_norm(x, norm.weight, 1e-6))
    norm.weight = torch.nn.Parameter(torch.zeros(shape[-1], dtype=dtype))  # replaced outright
    assert torch.equal(norm(x), hf_gemma3_rms_norm(x, norm.weight, 1e-6))
