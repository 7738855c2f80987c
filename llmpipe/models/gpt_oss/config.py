"""gpt-oss's own hyperparameters, from a config.json (transformers' GptOssConfig) or a GGUF's `gpt-oss.*`
metadata, and the layer pattern both imply: sliding-window (128) layers alternating with full ones, the
first sliding."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmpipe.errors import ModelLoadError

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # GptOssConfig's defaults; llama.cpp's graph has them as constants


@dataclass(frozen=True)
class GptOssFields:
    num_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float = SWIGLU_ALPHA  # the gate's sigmoid gain
    swiglu_limit: float = SWIGLU_LIMIT  # gate clamped above, up on both sides, to this

    def __post_init__(self) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}")


def alternating_layer_types(num_layers: int) -> tuple[str, ...]:
    """GptOssConfig's default (and llama.cpp's swa pattern 2): even layers slide, odd ones see everything."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))


def hf_gpt_oss_fields(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts is None:
        raise ModelLoadError(f"{path}: a gpt_oss config needs num_local_experts")
    layers = int(cfg["num_hidden_layers"])
    return {
        "extra": GptOssFields(int(experts), int(cfg.get("num_experts_per_tok", 4)),
                              float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)), float(cfg.get("swiglu_limit", SWIGLU_LIMIT))),
        "layer_types": tuple(cfg.get("layer_types") or alternating_layer_types(layers)),
        "attention_bias": bool(cfg.get("attention_bias", True)),
    }


def gguf_gpt_oss_fields(hp: Callable[..., Any]) -> dict[str, Any]:
    """llama.cpp's gpt-oss: the experts' width is expert_feed_forward_length; the clamped SwiGLU's constants
    are not stored (its graph uses GptOssConfig's)."""
    return {
        "extra": GptOssFields(int(hp("expert_count")), int(hp("expert_used_count"))),
        "intermediate_size": int(hp("expert_feed_forward_length")),
        "layer_types": alternating_layer_types(int(hp("block_count"))),
    }
