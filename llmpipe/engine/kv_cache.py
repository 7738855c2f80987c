"""Per-sequence KV cache: one contiguous K and V tensor per layer, allocated once for the
sequence's whole budget (prompt + max new tokens), written in place as it grows."""

from __future__ import annotations

import torch

from llmpipe.config import ModelConfig


class SequenceKVCache:
    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str):
        shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.buffer = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = capacity
        # [(k_cache, v_cache)] per layer, each [kv_heads, capacity, head_dim]
        self.layers = [(layer[0], layer[1]) for layer in self.buffer]

    def fork(self, num_tokens: int) -> "SequenceKVCache":
        """A copy holding the first num_tokens positions (for n > 1 samples of one prompt)."""
        twin = SequenceKVCache.__new__(SequenceKVCache)
        twin.buffer = torch.empty_like(self.buffer)
        twin.buffer[..., :num_tokens, :] = self.buffer[..., :num_tokens, :]
        twin.capacity = self.capacity
        twin.layers = [(layer[0], layer[1]) for layer in twin.buffer]
        return twin

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
