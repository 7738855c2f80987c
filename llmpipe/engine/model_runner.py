"""ModelRunner: turns "run these tokens of this sequence" into tensors, a forward pass and logits."""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmpipe.config import EngineConfig
from llmpipe.engine.kv_cache import SequenceKVCache
from llmpipe.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: nn.Module, config: EngineConfig):
        self.model = model
        self.config = config
        self.device = torch.device(config.device)
        self._decode_forward = self._forward
        if config.compile:
            logger.info("compiling the decode step with torch.compile")
            self._decode_forward = torch.compile(self._forward, dynamic=True)

    def allocate(self, capacity: int) -> SequenceKVCache:
        return SequenceKVCache(self.config.model_config, capacity, self.config.torch_dtype, self.device)

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], kv: SequenceKVCache) -> torch.Tensor:
        """Run the whole prompt in one forward pass, filling the cache; logits [1, vocab] of its last token."""
        return self._forward(self._tensor(token_ids), 0, kv)

    @torch.inference_mode()
    def decode(self, token_ids: list[int], kv: SequenceKVCache) -> torch.Tensor:
        """One new token on top of the cached past (or, with kv_cache=False, the whole sequence again)."""
        if not self.config.kv_cache:
            return self._forward(self._tensor(token_ids), 0, kv)
        return self._decode_forward(self._tensor(token_ids[-1:]), len(token_ids) - 1, kv)

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] at every position of token_ids (a fresh cache; for evaluation and tests)."""
        kv = self.allocate(len(token_ids))
        return self._forward(self._tensor(token_ids), 0, kv, all_positions=True)

    def _tensor(self, token_ids: list[int]) -> torch.Tensor:
        return torch.tensor(token_ids, dtype=torch.long, device=self.device)

    def _forward(
        self, input_ids: torch.Tensor, start: int, kv: SequenceKVCache, all_positions: bool = False
    ) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        positions = torch.arange(start, start + num_tokens, device=self.device)
        hidden = self.model(input_ids, positions, kv.layers, AttentionMetadata(start, num_tokens))
        return self.model.compute_logits(hidden if all_positions else hidden[-1:])
