"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.config import ModelConfig
from llmpipe.loader.gguf_names import GGUFArchitecture
from llmpipe.models.family import ModelFamily
from llmpipe.models.llama.model import STACKED_PARAMS, LlamaForCausalLM

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # Hugging Face model types

LLAMA_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
QKV_BIAS = {
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
}
QK_NORM = {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
# llama.cpp permutes these rows for the "llama" GGUF architecture only (see loader/gguf_names.py).
PERMUTED = {
    "blk.{i}.attn_q.weight": "num_attention_heads",
    "blk.{i}.attn_q.bias": "num_attention_heads",
    "blk.{i}.attn_k.weight": "num_key_value_heads",
    "blk.{i}.attn_k.bias": "num_key_value_heads",
}


class LlamaFamily(ModelFamily):
    name = "llama"
    model_class = LlamaForCausalLM
    model_types = LLAMA_FAMILY
    gguf = {
        # SmolLM2, Llama 2/3 and Mistral GGUFs all say "llama".
        "llama": GGUFArchitecture(tensors=LLAMA_TENSORS | QKV_BIAS, permuted=PERMUTED),
        "qwen2": GGUFArchitecture(tensors=LLAMA_TENSORS | QKV_BIAS),
        "qwen3": GGUFArchitecture(tensors=LLAMA_TENSORS | QK_NORM),
    }
    stacked = STACKED_PARAMS
    hf_architectures = {
        "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    }

    def hf_fields(self, cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        model_type = cfg["model_type"]
        own: dict[str, Any] = {
            "attention_bias": model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            "qk_norm": model_type == "qwen3",
        }
        if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            own["sliding_window"] = None  # Mistral uses its window whenever set; Qwen only with use_sliding_window
        return cfg, own

    def hf_config_fields(self, config: ModelConfig) -> dict[str, Any]:
        return {
            "attention_bias": config.attention_bias,
            "sliding_window": config.sliding_window,
            "use_sliding_window": config.sliding_window is not None,
        }


LLAMA = LlamaFamily()
