"""RMSNorm, computed in float32 like the reference implementations."""

import torch


class RMSNorm(torch.nn.Module):
    """unit_offset: scale by (1 + weight) in float32, then cast (Gemma); else weight × the cast norm (Llama)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Spelled out rather than F.rms_norm: on CPU the fused op costs more per call for decode-sized rows.
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)
