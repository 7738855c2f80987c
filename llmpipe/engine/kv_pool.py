"""The KV pool the engine allocates: the model family's cache class, its layout, and how many blocks
the engine config's memory budget holds."""

from __future__ import annotations

from torch import nn

from llmpipe.config import EngineConfig, ModelConfig
from llmpipe.errors import LLMPipeError
from llmpipe.kv_cache.layout import KVCacheLayout, kv_cache_specs
from llmpipe.kv_cache.paged import KVCache
from llmpipe.models.registry import family_of


def kv_cache_class(cfg: ModelConfig) -> type[KVCache]:
    return family_of(cfg.architecture).kv_cache_class


def plan_kv_pool(config: EngineConfig, model: nn.Module) -> tuple[KVCacheLayout, int, int]:
    """The model's KV cache layout (from the specs its layers report), bytes per block, and how many
    blocks the engine config allows."""
    cfg = model.config
    cache = kv_cache_class(cfg)
    layout = cache.layout(kv_cache_specs(model))
    block_bytes = cache.block_bytes(layout, cfg, config)
    num_blocks = config.max_num_blocks or config.kv_cache_memory // block_bytes
    if num_blocks < 1:
        raise LLMPipeError(f"kv_cache_memory={config.kv_cache_memory} bytes holds no KV block of {config.model}")
    return layout, block_bytes, num_blocks
