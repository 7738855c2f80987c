"""Phi-3's own config.json fields, read as transformers' `Phi3Config` reads them.

RoPE is the default one or LongRoPE (`rope_type` "longrope"; "su" and "yarn" are its legacy names,
which Phi3Config renames to "longrope" too), optionally on the first `partial_rotary_factor` of
each head's channels (Phi-4-mini: 0.75). LongRoPE's settings come back normalized: both factor
lists, original_max_position_embeddings and the attention factor cos/sin are multiplied by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.loader.hf_rope import hf_rope

LONGROPE_NAMES = ("longrope", "su", "yarn")


@dataclass(frozen=True)
class Phi3Fields:
    rotary_dim: int  # RoPE turns the first rotary_dim channels of each head; the rest pass unrotated


def phi3_hf_fields(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    rope_theta, scaling = hf_rope(cfg)
    if scaling is not None:
        scaling.pop("partial_rotary_factor", None)
    partial = float({**cfg, **(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
                    .get("partial_rotary_factor") or 1.0)
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise UnsupportedModelError(f"{path}: partial_rotary_factor {partial} gives {rotary_dim} of {head_dim} "
                                    "channels (need an even count in (0, head_dim])")
    if scaling is not None:
        scaling = _longrope(scaling, cfg, rotary_dim, path)
    return dict(rope_theta=rope_theta, rope_scaling=scaling, attention_bias=False, qk_norm=False,
                extra=Phi3Fields(rotary_dim=rotary_dim))


def _longrope(scaling: dict[str, Any], cfg: dict[str, Any], rotary_dim: int, path: Path) -> dict[str, Any]:
    rope_type = scaling["rope_type"]
    if rope_type not in LONGROPE_NAMES:
        raise UnsupportedModelError(f"{path}: Phi-3 RoPE scaling {rope_type!r} is not supported (default, longrope/su)")
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not isinstance(values, list) or len(values) != rotary_dim // 2:
            raise ModelLoadError(f"{path}: longrope {key} must be a list of {rotary_dim // 2} numbers, got {values!r}")
        factors[key] = [float(v) for v in values]
    max_len = int(cfg["max_position_embeddings"])
    # Phi3Config's top-level original_max_position_embeddings wins over the one in rope_parameters.
    original = int(cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                   or max_len)
    factor = float(scaling.get("factor") or max_len / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:  # transformers' _compute_longrope_parameters
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(rope_type="longrope", **factors, original_max_position_embeddings=original,
                attention_factor=float(attention_factor))
