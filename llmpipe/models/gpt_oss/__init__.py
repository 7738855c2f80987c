"""gpt-oss (gpt-oss-20b, gpt-oss-120b): Hugging Face directories (float experts, or OpenAI's MXFP4) and
GGUF `gpt-oss`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from llmpipe.config import ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.gguf_names import GGUFArchitecture
from llmpipe.loader.quant_config import QuantizationConfig
from llmpipe.models.family import ModelFamily
from llmpipe.models.gpt_oss.config import gguf_gpt_oss_fields, hf_gpt_oss_fields
from llmpipe.models.gpt_oss.model import GptOssForCausalLM
from llmpipe.models.gpt_oss.weights import GptOssSafetensorsWeights
from llmpipe.models.llama import LLAMA_TENSORS, QKV_BIAS
from llmpipe.models.llama.model import STACKED_PARAMS

TENSORS = {
    **{k: v for k, v in LLAMA_TENSORS.items() if not k.startswith(("blk.{i}.ffn_", "blk.{i}.attn_output"))},
    **QKV_BIAS,
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.attn_sinks.weight": "model.layers.{i}.self_attn.sinks",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.router.weight",
    "blk.{i}.ffn_gate_inp.bias": "model.layers.{i}.mlp.router.bias",
}
EXPERT_TENSORS = {
    f"blk.{{i}}.ffn_{gguf}_exps.{kind}": f"model.layers.{{i}}.mlp.experts.{{e}}.{hf}_proj.{kind}"
    for gguf, hf in (("gate", "gate"), ("up", "up"), ("down", "down")) for kind in ("weight", "bias")
}


class GptOssFamily(ModelFamily):
    name = "gpt_oss"
    model_class = GptOssForCausalLM
    model_types = ("gpt_oss",)
    gguf = {"gpt-oss": GGUFArchitecture(tensors=TENSORS, experts=EXPERT_TENSORS, end_of_turn="<|return|>")}
    stacked = STACKED_PARAMS
    hf_architectures = {"gpt_oss": "GptOssForCausalLM"}
    unsharded = "experts are not sharded yet"

    def hf_fields(self, cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        return cfg, hf_gpt_oss_fields(cfg, path)

    def gguf_fields(self, hp: Callable[..., Any]) -> dict[str, Any]:
        return gguf_gpt_oss_fields(hp)

    def hf_weights(self, directory: Path, quant: QuantizationConfig | None) -> GptOssSafetensorsWeights:
        if quant is not None and quant.method != "mxfp4":
            raise UnsupportedModelError(f"{directory}: gpt_oss checkpoints quantized with {quant.method} are not supported")
        return GptOssSafetensorsWeights(directory)

    def hf_config_fields(self, config: ModelConfig) -> dict[str, Any]:
        moe = config.extra
        return {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_tok,
                "swiglu_alpha": moe.swiglu_alpha, "swiglu_limit": moe.swiglu_limit, "attention_bias": config.attention_bias,
                "layer_types": list(config.layer_types), "sliding_window": config.sliding_window}

    def routing(self, config: ModelConfig) -> tuple[int, int]:
        return config.extra.num_experts, config.extra.num_experts_per_tok


GPT_OSS = GptOssFamily()
