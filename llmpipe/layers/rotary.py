"""Rotary position embeddings (RoPE) with the scaling variants real checkpoints use."""

from __future__ import annotations

import math
from typing import Any

import torch

from llmpipe.errors import UnsupportedModelError
from llmpipe.kernels import ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (transformers' `_compute_yarn_parameters`): keep the frequencies that turn more than beta_fast
    times over the original context, divide by `factor` those turning fewer than beta_slow times, and ramp
    linearly (in dimension index) between."""
    factor, context = _yarn_factor(scaling), scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times over the context
        return rotary_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    span = high - low if high != low else 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / span).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_factor(scaling: dict[str, Any]) -> float:
    if scaling.get("factor") is None:
        raise UnsupportedModelError("YaRN RoPE scaling needs a 'factor'")
    return float(scaling["factor"])


def _rope_type(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, rotary_dim, theta, scaling)
    raise UnsupportedModelError(f"RoPE scaling type {rope_type!r} is not supported (default, linear, llama3, yarn)")


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's `attention_factor`, by default 0.1 ln(factor) + 1
    (or the ratio of two such terms with DeepSeek's mscale / mscale_all_dim); 1 for the other types."""
    if _rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling)
    mscale = lambda m=1.0: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0  # noqa: E731
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale()


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables indexed by position; rotate-half layout (Hugging Face convention).

    The tables grow as positions arrive (to the next power of two, at most max_positions): a model's
    max_position_embeddings is often 128K, whose full tables (Llama-3.1-8B: 128 MiB) a 4K-token KV pool never
    reaches. Each row is a function of its position alone, so a table's rows are the same at any length."""

    MIN_ROWS = 4096
    halves = 2  # the angles cover half a head, repeated: both halves of a head turn alike (rotate-half)

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(0, self.table_width()), persistent=False)
        self.register_buffer("sin", torch.empty(0, self.table_width()), persistent=False)

    def table_width(self) -> int:
        return self.head_dim

    def reset_tables(self) -> None:
        """Empty the tables (they refill as positions arrive), e.g. after the model was built on the meta device."""
        self.cos, self.sin = self.cos.new_empty(0, self.table_width()), self.sin.new_empty(0, self.table_width())

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Each position's angles: float64 positions → [n, table width / halves]."""
        return torch.outer(positions, rope_inv_freq(self.head_dim, self.theta, self.scaling))

    def attention_factor(self) -> float:
        return rope_attention_factor(self.scaling)

    def cover(self, positions: torch.Tensor) -> None:
        """Grow the tables (in float32, from float64 angles) to hold these positions."""
        have = self.cos.shape[0]
        if have >= self.max_positions or not positions.numel():
            return
        needed = int(positions.max()) + 1
        if needed <= have:
            return
        rows = min(self.max_positions, max(1 << (needed - 1).bit_length(), self.MIN_ROWS))
        angles = self.angles(torch.arange(have, rows, dtype=torch.float64))
        scale, device = self.attention_factor(), self.cos.device
        self.cos = torch.cat([self.cos, (angles.cos() * scale).float().repeat(1, self.halves).to(device)])
        self.sin = torch.cat([self.sin, (angles.sin() * scale).float().repeat(1, self.halves).to(device)])

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, [T, 1, head_dim]: looked up once per forward, shared by all layers."""
        self.cover(positions)
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], rotate-half layout."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rotate_heads_(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, count: int) -> torch.Tensor:
    """apply_rotary on the first `count` heads of heads [T, heads, head_dim], in place (the same bits): in C where
    it applies, so a large step's q and k take no temporaries (five of their size in PyTorch)."""
    if (heads.dtype == cos.dtype == torch.float32 and heads.device.type == "cpu" and heads.is_contiguous()
            and cos.is_contiguous() and sin.is_contiguous() and ops.available()):
        ops.rope_heads(heads, cos, sin, count)
    else:
        heads[:, :count] = apply_rotary(heads[:, :count], cos, sin)
    return heads


class InterleavedRotaryEmbedding(RotaryEmbedding):
    """RoPE on consecutive channel pairs (x0, x1), (x2, x3), … of the last `rotary_dim` channels of
    each head (DeepSeek V4): tables hold one angle per pair, [positions, rotary_dim / 2]."""

    halves = 1

    def table_width(self) -> int:
        return self.head_dim // 2

    def tables(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim / 2] in float32 (the rotation runs in float32, as the reference's)."""
        self.cover(positions)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last 2 × cos.shape[-1] channels of x [..., heads, D] pairwise (in float32); the rest pass.
    cos, sin broadcast over heads: [..., 1, rotary_dim / 2]. Negate sin to rotate back."""
    rope_dim = 2 * cos.shape[-1]
    rope = x[..., -rope_dim:].float().unflatten(-1, (-1, 2))
    even, odd = rope[..., 0], rope[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)
