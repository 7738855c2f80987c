"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) and Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B,
Qwen3-235B-A22B): Hugging Face directories and GGUF `qwen2moe` / `qwen3moe`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from llmpipe.config import ModelConfig
from llmpipe.loader.gguf_names import GGUFArchitecture
from llmpipe.models.family import ModelFamily
from llmpipe.models.llama import LLAMA_TENSORS, QK_NORM, QKV_BIAS
from llmpipe.models.llama.model import STACKED_PARAMS
from llmpipe.models.qwen3_moe.config import gguf_moe_fields, hf_moe_fields
from llmpipe.models.qwen3_moe.model import Qwen3MoeForCausalLM

EXPERT_TENSORS = {
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
}
ROUTER = {"blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight"}
SHARED_EXPERT = {
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
}


class Qwen3MoeFamily(ModelFamily):
    name = "qwen3_moe"
    model_class = Qwen3MoeForCausalLM
    model_types = ("qwen2_moe", "qwen3_moe")
    gguf = {
        "qwen2moe": GGUFArchitecture(tensors=LLAMA_TENSORS | QKV_BIAS | ROUTER | SHARED_EXPERT, experts=EXPERT_TENSORS),
        "qwen3moe": GGUFArchitecture(tensors=LLAMA_TENSORS | QK_NORM | ROUTER, experts=EXPERT_TENSORS),
    }
    stacked = STACKED_PARAMS
    unsharded = "experts are not sharded yet"
    hf_architectures = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

    def hf_fields(self, cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        qwen2 = cfg["model_type"] == "qwen2_moe"  # qkv bias; Qwen3: q/k norms
        own: dict[str, Any] = {"qk_norm": not qwen2, "extra": hf_moe_fields(cfg, path),
                               "attention_bias": bool(cfg.get("qkv_bias", True) if qwen2 else cfg.get("attention_bias", False))}
        if not cfg.get("use_sliding_window", False):
            own["sliding_window"] = None  # as Qwen3: a window only with use_sliding_window
        return cfg, own

    def gguf_fields(self, hp: Callable[..., Any]) -> dict[str, Any]:
        return {"extra": gguf_moe_fields(hp)}

    def hf_config_fields(self, config: ModelConfig) -> dict[str, Any]:
        moe = config.extra
        return {
            "num_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_tok,
            "moe_intermediate_size": moe.moe_intermediate_size, "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i, sparse in enumerate(moe.sparse_layers) if not sparse],
            **({"shared_expert_intermediate_size": moe.shared_expert_intermediate_size, "qkv_bias": config.attention_bias}
               if config.architecture == "qwen2_moe" else {}),
        }

    def routing(self, config: ModelConfig) -> tuple[int, int]:
        return config.extra.num_experts, config.extra.num_experts_per_tok


QWEN3_MOE = Qwen3MoeFamily()
