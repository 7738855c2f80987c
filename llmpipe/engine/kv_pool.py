"""The KV pool the engine allocates: the model family's cache class, its layout, how many blocks
the engine config's memory budget holds, and the offload tier below it."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from pathlib import Path

from torch import nn

from llmpipe.config import EngineConfig, ModelConfig, parse_bytes
from llmpipe.errors import LLMPipeError
from llmpipe.kv_cache.disk_tier import DiskTier
from llmpipe.kv_cache.layout import KVCacheLayout, kv_cache_specs
from llmpipe.kv_cache.offload_tier import OffloadTier
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


TIER_FORMAT = 1  # bump when what a block holds changes meaning


def offload_tier(config: EngineConfig, checkpoint_path: Path, runner, layout: KVCacheLayout) -> OffloadTier | None:
    """The prefix cache's tiers below the pool, per the config (None: none). The disk tier's folder is named by
    what makes a block's contents what they are — the weights' files, the numerics, the cache's layout — so a
    restart finds its blocks and no other model or setting reads them."""
    if not config.kv_offload:
        return None
    kv_cache = runner.kv_cache
    if not hasattr(kv_cache, "read_block"):
        raise LLMPipeError(f"{config.model} keeps its KV cache its own way ({type(kv_cache).__name__}): "
                           "no offload tier under it")
    disk = None
    if config.kv_offload_dir is not None:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", checkpoint_path.name)[:64]
        fingerprint = cache_fingerprint(config, checkpoint_path, kv_cache, layout)
        folder = Path(config.kv_offload_dir).expanduser() / f"{name}-{fingerprint}"
        disk = DiskTier(folder, parse_bytes(config.kv_offload_disk, "kv_offload_disk"))
    return OffloadTier(config.kv_offload_memory, disk)


def cache_fingerprint(config: EngineConfig, checkpoint_path: Path, kv_cache: KVCache, layout: KVCacheLayout) -> str:
    files = [checkpoint_path] if checkpoint_path.is_file() else sorted(
        p for p in checkpoint_path.iterdir() if p.suffix in (".safetensors", ".gguf", ".json", ".bin"))
    parts = [
        TIER_FORMAT, str(checkpoint_path.resolve()),
        [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        repr(config.model_config), config.dtype, config.weight_quantization, config.group_size,
        config.activation_quantization, config.kv_cache_dtype, config.block_size, config.disable_sliding_window,
        repr(layout), [(str(t.dtype), t.shape[:2] + t.shape[3:]) for t in kv_cache.tensors],
    ]
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()
