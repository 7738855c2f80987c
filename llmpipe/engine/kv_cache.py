"""The paged KV cache: one preallocated tensor per layer, [2 (K, V), blocks, block_size, kv_heads, head_dim],
sized from a memory budget and addressed by block tables."""

from __future__ import annotations

import torch

from llmpipe.config import EngineConfig, ModelConfig
from llmpipe.errors import LLMPipeError
from llmpipe.quant.kv import KV_INT4_GROUP, SCALE_DTYPE, QuantizedKV
from llmpipe.models.deepseek_v4.cache import CompressedKVCache, CompressedKVLayout, check_supported, compressed_kv_layout
from llmpipe.engine.kv_cache_spec import KVCacheLayout, kv_cache_layout


KV_SCALE_BYTES = torch.empty((), dtype=SCALE_DTYPE).element_size()


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """2 (K and V) × layers × kv_heads × bytes per head vector.

    auto: head_dim elements of `dtype`; int8: head_dim bytes + one scale per token and head;
    int4: head_dim / 2 bytes + a scale and a minimum per group of KV_INT4_GROUP dims.
    """
    vectors = cfg.kv_elements_per_token // cfg.head_dim
    if kv_cache_dtype == "int8":
        per_vector = cfg.head_dim + KV_SCALE_BYTES
    elif kv_cache_dtype == "int4":
        groups = -(-cfg.head_dim // KV_INT4_GROUP)
        per_vector = cfg.head_dim // 2 + 2 * KV_SCALE_BYTES * groups
    else:
        per_vector = cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    return vectors * per_vector


def num_blocks_for(
    memory_bytes: int, cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    return memory_bytes // (kv_bytes_per_token(cfg, dtype, kv_cache_dtype) * block_size)


def plan_kv_pool(config: EngineConfig, cfg: ModelConfig) -> tuple[KVCacheLayout, int, int]:
    """The model's KV cache layout, bytes per block, and how many blocks the engine config allows."""
    if cfg.deepseek_v4 is not None:
        check_supported(config)
        layout = compressed_kv_layout(cfg)
        block_bytes = config.block_size * layout.row_elements * config.torch_dtype.itemsize
    else:
        layout = kv_cache_layout(cfg)
        block_bytes = layout.block_bytes(kv_bytes_per_token(cfg, config.torch_dtype, config.kv_cache_dtype), config.block_size)
    num_blocks = config.max_num_blocks or config.kv_cache_memory // block_bytes
    if num_blocks < 1:
        raise LLMPipeError(f"kv_cache_memory={config.kv_cache_memory} bytes holds no KV block of {config.model}")
    return layout, block_bytes, num_blocks


class PagedKVCache:
    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device,
        layout: KVCacheLayout | None = None, kv_cache_dtype: str = "auto",
    ):
        # A block holds `slots_per_block` layers (one KV cache group's); each layer reads its slot.
        layout = layout or kv_cache_layout(cfg)
        shape = (layout.slots_per_block, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        if kv_cache_dtype == "auto":
            self.tensors: tuple[torch.Tensor, ...] = (torch.zeros(shape, dtype=dtype, device=device),)
            self.layers = [self.tensors[0][slot] for slot in layout.layer_slots]  # what each attention layer receives
        else:
            codes, scale, minimum = QuantizedKV.storage(kv_cache_dtype, shape, device)
            self.tensors = tuple(t for t in (codes, scale, minimum) if t is not None)
            self.layers = [
                QuantizedKV(codes[s], scale[s], None if minimum is None else minimum[s], cfg.head_dim)
                for s in layout.layer_slots
            ]
        self.bytes_per_token = kv_bytes_per_token(cfg, dtype, kv_cache_dtype)

    def copy_block(self, src: int, dst: int) -> None:
        for tensor in self.tensors:
            tensor[:, :, dst] = tensor[:, :, src]


def make_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device, layout: KVCacheLayout,
    kv_cache_dtype: str = "auto",
) -> PagedKVCache | CompressedKVCache:
    if isinstance(layout, CompressedKVLayout):
        return CompressedKVCache(layout, num_blocks, block_size, dtype, device)
    return PagedKVCache(cfg, num_blocks, block_size, dtype, device, layout, kv_cache_dtype)
