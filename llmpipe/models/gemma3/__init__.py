"""Gemma 3 (text)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from llmpipe.loader.gguf_names import GGUFArchitecture
from llmpipe.models.family import ModelFamily
from llmpipe.models.gemma3.config import gemma3_gguf_fields, gemma3_hf_fields
from llmpipe.models.gemma3.model import Gemma3ForCausalLM
from llmpipe.models.llama import QK_NORM
from llmpipe.models.llama.model import STACKED_PARAMS

GEMMA3_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
} | QK_NORM


class Gemma3Family(ModelFamily):
    name = "gemma3"
    model_class = Gemma3ForCausalLM
    model_types = ("gemma3_text",)
    gguf = {"gemma3": GGUFArchitecture(tensors=GEMMA3_TENSORS, norms_store_one_plus_weight=True,
                                       end_of_turn="<end_of_turn>")}
    stacked = STACKED_PARAMS

    def hf_fields(self, cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        return cfg, gemma3_hf_fields(cfg, path)

    def gguf_fields(self, hp: Callable[..., Any]) -> dict[str, Any]:
        return gemma3_gguf_fields(hp)


GEMMA3 = Gemma3Family()
