"""The hybrid mixtures of experts' hyperparameters: Qwen3.5's linear-attention fields with Qwen3-MoE's experts beside
them, from a config.json (transformers' Qwen3_5MoeTextConfig / Qwen3NextConfig, their defaults filled in) or a GGUF's
`qwen35moe.*` / `qwen3next.*` metadata (every layer sparse, as llama.cpp loads them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmpipe.models.qwen3_5.config import Qwen35Fields
from llmpipe.models.qwen3_moe.config import Qwen3MoeFields, gguf_moe_fields, hf_moe_fields

# transformers' defaults for what a config.json may leave out
QWEN3_5_MOE_DEFAULTS = {"num_experts_per_tok": 8, "shared_expert_intermediate_size": 512}
QWEN3_NEXT_DEFAULTS = {"num_experts_per_tok": 10, "shared_expert_intermediate_size": 512, "norm_topk_prob": True}


@dataclass(frozen=True)
class Qwen35MoeFields(Qwen35Fields):
    """Qwen3.5's fields, and the experts: Qwen3-MoE's fields, which its sparse block reads as its config's extra."""

    moe: Qwen3MoeFields | None = None


def with_experts(fields: Qwen35Fields, moe: Qwen3MoeFields) -> Qwen35MoeFields:
    return Qwen35MoeFields(**dataclasses.asdict(fields), moe=moe)


def qwen3_5_moe_hf_fields(cfg: dict[str, Any], path: Path) -> Qwen3MoeFields:
    """Qwen3.5-MoE: every layer sparse, the top-k weights always renormalized (its router has no norm_topk_prob)."""
    return hf_moe_fields({**QWEN3_5_MOE_DEFAULTS, **cfg, "norm_topk_prob": True, "decoder_sparse_step": 1,
                          "mlp_only_layers": []}, path)


def qwen3_next_hf_fields(cfg: dict[str, Any], path: Path) -> Qwen3MoeFields:
    """Qwen3-Next: Qwen3-MoE's rule for the sparse layers (mlp_only_layers, decoder_sparse_step)."""
    return hf_moe_fields({**QWEN3_NEXT_DEFAULTS, **cfg}, path)


def gguf_hybrid_moe_fields(hp: Callable[..., Any], layers: int) -> Qwen3MoeFields:
    """llama.cpp's graphs renormalize the top-k weights (norm_w) and give every one of the `layers` experts."""
    return dataclasses.replace(gguf_moe_fields(hp), norm_topk_prob=True, sparse_layers=(True,) * layers)


def moe_config_fields(moe: Qwen3MoeFields) -> dict[str, Any]:
    """What hf_config_dict adds for the experts (read back by qwen3_5_moe_hf_fields / qwen3_next_hf_fields)."""
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_tok,
            "moe_intermediate_size": moe.moe_intermediate_size,
            "shared_expert_intermediate_size": moe.shared_expert_intermediate_size}
