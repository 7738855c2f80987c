"""The KV pool the engine allocates: the model family's cache class, its layout, and how many blocks
the engine config's memory budget holds."""

from __future__ import annotations

from dataclasses import replace

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
    blocks the engine config allows. A model whose layers keep a state per sequence gets its state pool
    first (state_slots), the token blocks the rest of the budget."""
    cfg = model.config
    cache = kv_cache_class(cfg)
    layout = cache.layout(kv_cache_specs(model))
    block_bytes = cache.block_bytes(layout, cfg, config)
    budget, slots = config.kv_cache_memory, 0
    if layout.state_group is not None:
        slots = state_slots(config, layout.state_bytes())
        budget -= slots * layout.state_bytes()
    num_blocks = config.max_num_blocks or budget // block_bytes
    if num_blocks < 1:
        raise LLMPipeError(f"kv_cache_memory={config.kv_cache_memory} bytes holds no KV block of {config.model}")
    if slots:
        layout = with_state_pool(layout, slots, first_id=num_blocks)
    return layout, block_bytes, num_blocks


def state_slots(config: EngineConfig, state_bytes: int) -> int:
    """States in the pool: two per sequence that may run (its live state, and a checkpoint a step writes or the
    prefix cache keeps), within half the KV budget; at least two."""
    fit = config.kv_cache_memory // 2 // state_bytes
    if fit < 2:
        raise LLMPipeError(f"kv_cache_memory={config.kv_cache_memory} bytes holds fewer than 2 recurrent states of "
                           f"{config.model} ({state_bytes} bytes each): give it at least {4 * state_bytes} bytes")
    return min(2 * config.max_num_seqs, fit)


def with_state_pool(layout: KVCacheLayout, slots: int, first_id: int) -> KVCacheLayout:
    """The layout with its state group's pool sized: `slots` states, ids from first_id (after the token blocks)."""
    groups = tuple(replace(g, spec=replace(g.spec, slots=slots, first_id=first_id)) if g.spec.per_sequence else g
                   for g in layout.groups)
    return replace(layout, groups=groups)
