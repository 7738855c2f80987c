"""Qwen2-MoE's and Qwen3-MoE's own hyperparameters, from a config.json (transformers' Qwen2MoeConfig /
Qwen3MoeConfig: both the saved `num_local_experts` and the published checkpoints' `num_experts`) or a
GGUF's `qwen2moe.*` / `qwen3moe.*` metadata."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmpipe.errors import ModelLoadError


@dataclass(frozen=True)
class Qwen3MoeFields:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool  # the top-k probabilities renormalized to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert this wide, sigmoid-gated (0: none)

    def __post_init__(self) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}")


def hf_moe_fields(cfg: dict[str, Any], path: Path) -> Qwen3MoeFields:
    """transformers' rule: layer i has experts unless listed in mlp_only_layers, where (i + 1) % decoder_sparse_step == 0."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None or cfg.get("moe_intermediate_size") is None:
        raise ModelLoadError(f"{path}: a qwen3_moe config needs num_experts and moe_intermediate_size")
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
    layers = int(cfg["num_hidden_layers"])
    sparse = tuple(i not in dense and int(experts) > 0 and (i + 1) % step == 0 for i in range(layers))
    return Qwen3MoeFields(int(experts), int(cfg.get("num_experts_per_tok", 8)), int(cfg["moe_intermediate_size"]),
                          bool(cfg.get("norm_topk_prob", False)), sparse, int(cfg.get("shared_expert_intermediate_size") or 0))


def gguf_moe_fields(hp: Callable[..., Any]) -> Qwen3MoeFields:
    """llama.cpp's qwen2moe / qwen3moe: every layer has experts; qwen2moe's shared expert as wide as its
    metadata says; the top-k weights renormalized for qwen3moe only (its graphs' norm_w)."""
    shared = int(hp("expert_shared_feed_forward_length", 0))
    return Qwen3MoeFields(int(hp("expert_count")), int(hp("expert_used_count")), int(hp("expert_feed_forward_length")),
                          not shared, (True,) * int(hp("block_count")), shared)
