"""Qwen3.5, dense, text only: Hugging Face directories of Qwen3_5ForCausalLM (`qwen3_5_text`) or of the
multimodal Qwen3_5ForConditionalGeneration (`qwen3_5`, read as its text model)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmpipe.config import EngineConfig, ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.quant_config import QuantizationConfig
from llmpipe.models.family import ModelFamily
from llmpipe.models.qwen3_5.config import qwen35_hf_config_fields, qwen35_hf_fields, text_config
from llmpipe.models.qwen3_5.model import STACKED_PARAMS, Qwen35ForCausalLM
from llmpipe.models.qwen3_5.weights import text_weights

if TYPE_CHECKING:
    from llmpipe.loader.checkpoint import WeightSource


class Qwen35Family(ModelFamily):
    name = "qwen3_5"
    model_class = Qwen35ForCausalLM
    model_types = ("qwen3_5_text", "qwen3_5")
    stacked = STACKED_PARAMS
    hf_architectures = {"qwen3_5_text": "Qwen3_5ForCausalLM"}

    def hf_fields(self, cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        text = text_config(cfg)
        return text, qwen35_hf_fields(text, path)

    def hf_weights(self, directory: Path, quant: QuantizationConfig | None) -> WeightSource:
        return text_weights(super().hf_weights(directory, quant))

    def hf_config_fields(self, config: ModelConfig) -> dict[str, Any]:
        return qwen35_hf_config_fields(config.extra, config.layer_types, config.attention_bias)

    def check_engine_options(self, config: EngineConfig) -> None:
        """A recurrent state cannot be rolled back past rejected draft tokens, and its layers are not sharded."""
        if config.speculative_method is not None:
            raise UnsupportedModelError(f"{self.name}: speculative decoding is not supported (a linear-attention state "
                                        "cannot be rolled back)")
        if config.tensor_parallel_size > 1:
            raise UnsupportedModelError(f"{self.name}: tensor_parallel_size > 1 is not supported (linear attention is "
                                        "not sharded)")


QWEN3_5 = Qwen35Family()
