"""RoPE scaling of a GGUF, as a Hugging Face `rope_scaling` dict.

llama.cpp stores linear/YaRN scaling as `{arch}.rope.scaling.*` metadata, but Llama 3's scaling
only as a `rope_freqs.weight` tensor: one divisor per frequency, 1 for short wavelengths, `factor`
for long ones, a smooth ramp between. The ramp is linear in 1/wavelength, so two points on it fix
the Hugging Face parameters (taking low_freq_factor = 1, as every Llama 3 release does).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from llmpipe.errors import UnsupportedModelError

_TOLERANCE = 1e-4


def rope_scaling_from_metadata(meta: dict[str, Any]) -> dict[str, Any] | None:
    """`meta` holds the `rope.scaling.*` keys with the prefix removed ('type', 'factor', …)."""
    rope_type = meta.get("type")
    if rope_type in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(meta.get("factor", 1.0))}
    renames = {
        "original_context_length": "original_max_position_embeddings",
        "attn_factor": "attention_factor",
        "yarn_beta_fast": "beta_fast",
        "yarn_beta_slow": "beta_slow",
    }
    scaling.update({hf: meta[key] for key, hf in renames.items() if key in meta})
    return scaling


def llama3_frequency_factors(theta: float, dim: int, params: dict[str, float]) -> torch.Tensor:
    """llama.cpp's `rope_freqs` for Hugging Face llama3 parameters (its convert_hf_to_gguf formula)."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    wavelen = 2 * math.pi / freqs
    context = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    smooth = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def llama3_scaling_from_factors(
    factors: torch.Tensor, theta: float, dim: int, path: Path
) -> dict[str, Any] | None:
    """Recover {'rope_type': 'llama3', …} from a rope_freqs tensor; None when it scales nothing.

    Any parameters that reproduce the factors at this model's frequencies are equivalent, so
    with fewer than two points on the ramp Llama 3's high_freq_factor of 4 is assumed.
    """
    factors = factors.double().flatten()
    factor = float(factors.max())
    if factor <= 1.0 + _TOLERANCE:
        return None
    if factors.numel() != dim // 2:
        raise UnsupportedModelError(f"{path}: rope_freqs.weight has {factors.numel()} values, expected {dim // 2}")
    wavelen = 2 * math.pi * theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    on_ramp = (smooth > _TOLERANCE) & (smooth < 1 - _TOLERANCE)
    ramp = _ramp(wavelen[on_ramp], smooth[on_ramp], wavelen[smooth <= _TOLERANCE])
    if ramp is None:
        raise UnsupportedModelError(f"{path}: rope_freqs.weight does not match Llama 3 RoPE scaling")
    high, context = ramp
    params = {
        "factor": round(factor, 4),
        "low_freq_factor": 1.0,
        "high_freq_factor": round(high, 4),
        "original_max_position_embeddings": round(context),
    }
    if not torch.allclose(llama3_frequency_factors(theta, dim, params), factors, rtol=1e-4):
        raise UnsupportedModelError(f"{path}: rope_freqs.weight does not match Llama 3 RoPE scaling")
    return {"rope_type": "llama3", **params}


def _ramp(wavelen: torch.Tensor, smooth: torch.Tensor, scaled: torch.Tensor) -> tuple[float, float] | None:
    """(high_freq_factor, original context) with smooth = (context/wavelen − 1)/(high − 1)."""
    if wavelen.numel() >= 2:  # smooth = a·(1/wavelen) + b: a = context/(high − 1), b = −1/(high − 1)
        inv = 1.0 / wavelen
        design = torch.stack([inv, torch.ones_like(inv)], dim=1)
        a, b = torch.linalg.lstsq(design, smooth.unsqueeze(1)).solution.flatten().tolist()
        return (1.0 - 1.0 / b, -a / b) if b < 0 else None
    high = 4.0
    if wavelen.numel() == 1:
        return high, float(wavelen[0] * (1 + smooth[0] * (high - 1)))
    return high, float(scaled.min())  # no ramp point: the ramp ends at the first scaled wavelength
