"""The paged KV cache: one preallocated tensor per layer, [2 (K, V), blocks, block_size, kv_heads, head_dim],
sized from a memory budget and addressed by block tables.

A model family names its cache class (`ModelFamily.kv_cache_class`): PagedKVCache here, or one of the
family's own with the same three entry points (`layout`, `block_bytes`, `build`)."""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from llmpipe.config import EngineConfig, ModelConfig
from llmpipe.kernels import huge_pages
from llmpipe.quant.kv import KV_INT4_GROUP, SCALE_DTYPE, QuantizedKV
from llmpipe.kv_cache.kinds import KVCacheSpec, RecurrentState
from llmpipe.kv_cache.layout import KVCacheLayout, kv_cache_layout


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


class KVCache(Protocol):
    """What the engine uses of a family's KV cache class."""

    layers: list  # what each attention layer receives
    tensors: tuple[torch.Tensor, ...]  # the storage, block index in dimension 2 (PagedKVCache) or 0
    bytes_per_token: int

    @classmethod
    def layout(cls, specs: Sequence) -> KVCacheLayout:
        """The pool's layout for the specs the model's layers report (layout.kv_cache_specs)."""

    @classmethod
    def block_bytes(cls, layout: KVCacheLayout, cfg: ModelConfig, config: EngineConfig) -> int: ...

    @classmethod
    def build(cls, cfg: ModelConfig, layout: KVCacheLayout, num_blocks: int, config: EngineConfig,
              device: torch.device) -> "KVCache": ...

    def copy_block(self, src: int, dst: int) -> None: ...

    # Optional: a cache class with these two can have an offload tier (kv_cache/offload_tier.py) under it.
    # def read_block(self, block_id: int) -> tuple[torch.Tensor, ...]: a copy of the block in every storage tensor
    # def write_block(self, block_id: int, tensors: Sequence[torch.Tensor]) -> None: the inverse


class PagedKVCache:
    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device,
        layout: KVCacheLayout, kv_cache_dtype: str = "auto",
    ):
        # A block holds `slots_per_block` layers (one KV cache group's); each layer reads its slot.
        shape = (layout.slots_per_block, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        if kv_cache_dtype == "auto":
            self.tensors: tuple[torch.Tensor, ...] = (huge_pages.zeros(shape, dtype, device),)
            slot_view = lambda s: self.tensors[0][s]  # noqa: E731
        else:
            codes, scale, minimum = QuantizedKV.storage(kv_cache_dtype, shape, device)
            self.tensors = tuple(t for t in (codes, scale, minimum) if t is not None)
            slot_view = lambda s: QuantizedKV(codes[s], scale[s], None if minimum is None else minimum[s], cfg.head_dim)  # noqa: E731
        self.states, self.first_state = self._state_pool(layout, device)
        # What each layer receives: its slot of the token blocks, or its states.
        self.layers = [self.states[slot] if layout.groups[group].spec.per_sequence else slot_view(slot)
                       for slot, group in zip(layout.layer_slots, layout.layer_groups)]
        self.bytes_per_token = kv_bytes_per_token(cfg, dtype, kv_cache_dtype)

    @staticmethod
    def _state_pool(layout: KVCacheLayout, device) -> tuple[list[RecurrentState], int]:
        """Per layer keeping a state per sequence: its conv and SSM states, [slots, ...] each (float32)."""
        group = layout.state_group
        if group is None:
            return [], 0
        spec, count = group.spec, len(group.layers)
        conv = torch.zeros(count, spec.slots, *spec.conv_shape, device=device)
        ssm = torch.zeros(count, spec.slots, *spec.ssm_shape, device=device)
        return [RecurrentState(conv[j], ssm[j]) for j in range(count)], spec.first_id

    @classmethod
    def layout(cls, specs: Sequence[KVCacheSpec]) -> KVCacheLayout:
        return kv_cache_layout(specs)

    @classmethod
    def block_bytes(cls, layout: KVCacheLayout, cfg: ModelConfig, config: EngineConfig) -> int:
        return layout.block_bytes(kv_bytes_per_token(cfg, config.torch_dtype, config.kv_cache_dtype), config.block_size)

    @classmethod
    def build(cls, cfg: ModelConfig, layout: KVCacheLayout, num_blocks: int, config: EngineConfig,
              device: torch.device) -> "PagedKVCache":
        return cls(cfg, num_blocks, config.block_size, config.torch_dtype, device, layout, config.kv_cache_dtype)

    def copy_block(self, src: int, dst: int) -> None:
        if self.states and src >= self.first_state:  # a state's id follows the token blocks'
            for state in self.states:
                state.copy(src - self.first_state, dst - self.first_state)
            return
        for tensor in self.tensors:
            tensor[:, :, dst] = tensor[:, :, src]

    def read_block(self, block_id: int) -> tuple[torch.Tensor, ...]:
        """A copy of a token block (every layer of its group, K and V, and a quantized cache's scales)."""
        return tuple(tensor[:, :, block_id].clone() for tensor in self.tensors)

    def write_block(self, block_id: int, tensors: Sequence[torch.Tensor]) -> None:
        for tensor, saved in zip(self.tensors, tensors, strict=True):
            tensor[:, :, block_id] = saved
