"""DeepSeek V4: compressed attention, hash / top-k MoE, hyper-connections (Hugging Face directories only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from llmpipe.config import EngineConfig, ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.models.deepseek_v4.cache import CompressedKVCache
from llmpipe.models.deepseek_v4.config import deepseek_v4_config
from llmpipe.models.deepseek_v4.model import DeepseekV4ForCausalLM
from llmpipe.models.deepseek_v4.weights import checkpoint_tensors
from llmpipe.models.family import ModelFamily, Shape


class DeepseekV4Family(ModelFamily):
    name = "deepseek_v4"
    model_class = DeepseekV4ForCausalLM
    model_types = ("deepseek_v4",)
    kv_cache_class = CompressedKVCache  # type: ignore[assignment]  # window and entry stores in one pool

    def hf_fields(self, cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        cfg, fields = deepseek_v4_config(cfg, path)
        return cfg, {"extra": fields}

    def routing(self, config: ModelConfig) -> tuple[int, int]:
        return config.extra.num_experts, config.extra.num_experts_per_tok

    def checkpoint_tensors(self, model: nn.Module, param: str, shape: Shape) -> dict[str, Shape]:
        return checkpoint_tensors(param, shape)

    def check_engine_options(self, config: EngineConfig) -> None:
        """What the compressed cache does not take yet (one-line errors, before anything is loaded)."""
        if config.kv_cache_dtype != "auto":
            raise UnsupportedModelError(
                f"kv_cache_dtype={config.kv_cache_dtype!r}: DeepSeek V4's compressed cache is stored in the model dtype")
        if config.tensor_parallel_size != 1:
            raise UnsupportedModelError("DeepSeek V4 does not run under tensor parallelism yet")
        if config.disable_sliding_window:
            raise UnsupportedModelError("DeepSeek V4's sliding window is part of its attention: it cannot be disabled")


DEEPSEEK_V4 = DeepseekV4Family()
