"""Qwen3.5, dense, text only: Hugging Face directories of Qwen3_5ForCausalLM (`qwen3_5_text`) or of the
multimodal Qwen3_5ForConditionalGeneration (`qwen3_5`, read as its text model), and GGUF `qwen35`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from llmpipe.config import EngineConfig, ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.gguf_names import GGUFArchitecture
from llmpipe.loader.quant_config import QuantizationConfig
from llmpipe.models.family import ModelFamily
from llmpipe.models.llama import LLAMA_TENSORS, QK_NORM
from llmpipe.models.qwen3_5.config import qwen35_gguf_fields, qwen35_hf_config_fields, qwen35_hf_fields, text_config
from llmpipe.models.qwen3_5.model import STACKED_PARAMS, Qwen35ForCausalLM
from llmpipe.models.qwen3_5.weights import text_weights

if TYPE_CHECKING:
    from llmpipe.loader.checkpoint import WeightSource


def _minus_one(weight: torch.Tensor) -> torch.Tensor:
    return weight - 1


LINEAR = "model.layers.{i}.linear_attn."
TENSORS = {
    **{k: v for k, v in LLAMA_TENSORS.items() if not k.startswith("blk.{i}.ffn_norm")},
    **QK_NORM,
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_qkv.weight": LINEAR + "in_proj_qkv.weight",
    "blk.{i}.attn_gate.weight": LINEAR + "in_proj_z.weight",
    "blk.{i}.ssm_beta.weight": LINEAR + "in_proj_b.weight",
    "blk.{i}.ssm_alpha.weight": LINEAR + "in_proj_a.weight",
    "blk.{i}.ssm_a": LINEAR + "A_log",
    "blk.{i}.ssm_dt.bias": LINEAR + "dt_bias",
    "blk.{i}.ssm_conv1d.weight": LINEAR + "conv1d.weight",
    "blk.{i}.ssm_norm.weight": LINEAR + "norm.weight",
    "blk.{i}.ssm_out.weight": LINEAR + "out_proj.weight",
}
# What llama.cpp's converter changed (its Qwen3NextModel.modify_tensors): 1 + weight for the zero-centred norms
# (not the linear layers' gated norm), A = −exp(A_log), the conv's weight squeezed to [channels, kernel].
VALUES = {
    **{name: _minus_one for name in ("output_norm.weight", "blk.{i}.attn_norm.weight", "blk.{i}.post_attention_norm.weight",
                                     "blk.{i}.attn_q_norm.weight", "blk.{i}.attn_k_norm.weight")},
    "blk.{i}.ssm_a": lambda a: torch.log(-a),
    "blk.{i}.ssm_conv1d.weight": lambda w: w.unsqueeze(1),
}


class Qwen35Family(ModelFamily):
    name = "qwen3_5"
    model_class = Qwen35ForCausalLM
    model_types = ("qwen3_5_text", "qwen3_5")
    gguf = {"qwen35": GGUFArchitecture(tensors=TENSORS, values=VALUES, partial_rotary=True)}
    stacked = STACKED_PARAMS
    hf_architectures = {"qwen3_5_text": "Qwen3_5ForCausalLM"}
    unsharded = "linear attention is not sharded"

    def hf_fields(self, cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        text = text_config(cfg)
        return text, qwen35_hf_fields(text, path)

    def gguf_fields(self, hp: Callable[..., Any]) -> dict[str, Any]:
        return qwen35_gguf_fields(hp)

    def hf_weights(self, directory: Path, quant: QuantizationConfig | None) -> WeightSource:
        return text_weights(super().hf_weights(directory, quant))

    def hf_config_fields(self, config: ModelConfig) -> dict[str, Any]:
        return qwen35_hf_config_fields(config.extra, config.layer_types, config.attention_bias)

    def check_engine_options(self, config: EngineConfig) -> None:
        """A recurrent state cannot be rolled back past rejected draft tokens, and its layers are not sharded."""
        if config.speculative_method is not None:
            raise UnsupportedModelError(f"{self.name}: speculative decoding is not supported (a linear-attention state "
                                        "cannot be rolled back)")
        super().check_engine_options(config)


QWEN3_5 = Qwen35Family()
