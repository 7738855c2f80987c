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
