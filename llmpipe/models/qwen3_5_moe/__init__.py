"""Qwen3.5-MoE (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B), text only: Hugging Face directories of
Qwen3_5MoeForCausalLM (`qwen3_5_moe_text`) or of the multimodal Qwen3_5MoeForConditionalGeneration (`qwen3_5_moe`,
read as its text model), and GGUF `qwen35moe`. Qwen3.5's model with Qwen3-MoE's sparse block in place of every
MLP: a softmax router's top-k experts, renormalized, and a shared expert scaled by a sigmoid gate. The experts load
as transformers saves them (one matrix each) or as Qwen's checkpoints hold them (3-D `gate_up_proj` / `down_proj`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from llmpipe.config import ModelConfig
from llmpipe.loader.fused_experts import FusedExpertWeights
from llmpipe.loader.gguf_names import GGUFArchitecture
from llmpipe.loader.quant_config import QuantizationConfig
from llmpipe.models.qwen3_5 import TENSORS, VALUES, Qwen35Family
from llmpipe.models.qwen3_5.config import qwen35_gguf_fields
from llmpipe.models.qwen3_5.weights import text_weights
from llmpipe.models.qwen3_5_moe.config import (gguf_hybrid_moe_fields, moe_config_fields, qwen3_5_moe_hf_fields,
                                               with_experts)
from llmpipe.models.qwen3_moe import EXPERT_TENSORS, ROUTER, SHARED_EXPERT
from llmpipe.models.qwen3_moe.config import Qwen3MoeFields

if TYPE_CHECKING:
    from llmpipe.loader.checkpoint import WeightSource

MOE_TENSORS = {**TENSORS, **ROUTER, **SHARED_EXPERT}


class Qwen35MoeFamily(Qwen35Family):
    name = "qwen3_5_moe"
    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    gguf = {"qwen35moe": GGUFArchitecture(tensors=MOE_TENSORS, experts=EXPERT_TENSORS, values=VALUES, partial_rotary=True)}
    hf_architectures = {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
    unsharded = "neither linear attention nor experts are sharded"

    def hf_fields(self, cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        text, own = super().hf_fields(cfg, path)
        moe = self.hf_moe_fields(text, path)
        # no dense MLP: the experts' width stands for it (what the config writer and llmpipe memory read)
        return {"intermediate_size": moe.moe_intermediate_size, **text}, {**own, "extra": with_experts(own["extra"], moe)}

    def hf_moe_fields(self, cfg: dict[str, Any], path: Path) -> Qwen3MoeFields:
        return qwen3_5_moe_hf_fields(cfg, path)

    def gguf_fields(self, hp: Callable[..., Any]) -> dict[str, Any]:
        own = self.gguf_linear_fields(hp)
        return {**own, "extra": with_experts(own["extra"], gguf_hybrid_moe_fields(hp, own["num_hidden_layers"]))}

    def gguf_linear_fields(self, hp: Callable[..., Any]) -> dict[str, Any]:
        return qwen35_gguf_fields(hp)

    def hf_weights(self, directory: Path, quant: QuantizationConfig | None) -> WeightSource:
        return text_weights(FusedExpertWeights(directory)) if quant is None else super().hf_weights(directory, quant)

    def hf_config_fields(self, config: ModelConfig) -> dict[str, Any]:
        return {**super().hf_config_fields(config), **moe_config_fields(config.extra.moe)}

    def routing(self, config: ModelConfig) -> tuple[int, int]:
        return config.extra.moe.num_experts, config.extra.moe.num_experts_per_tok


QWEN3_5_MOE = Qwen35MoeFamily()
