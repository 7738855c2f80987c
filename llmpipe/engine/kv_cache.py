"""The paged KV cache: one preallocated tensor per layer, [2 (K, V), blocks, block_size, kv_heads, head_dim],
sized from a memory budget and addressed by block tables."""

from __future__ import annotations

import torch

from llmpipe.config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """2 (K and V) × layers × kv_heads × head_dim × bytes per element."""
    return cfg.kv_elements_per_token * torch.empty((), dtype=dtype).element_size()


def num_blocks_for(memory_bytes: int, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return memory_bytes // (kv_bytes_per_token(cfg, dtype) * block_size)


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        shape = (cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = list(self.tensor)  # per-layer views, what the model's attention layers receive
        self.bytes_per_token = kv_bytes_per_token(cfg, dtype)

    def copy_block(self, src: int, dst: int) -> None:
        self.tensor[:, :, dst] = self.tensor[:, :, src]
