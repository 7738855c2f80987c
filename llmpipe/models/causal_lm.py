"""The top module every family shares: a body (`model_class`) and an LM head, tied to the embedding or not."""

from __future__ import annotations

import torch
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.layers.linear import Linear, linear


class CausalLM(nn.Module):
    model_class: type[nn.Module]  # the body: (input_ids, positions, kv_caches, metas) → hidden states

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg)
        tied = cfg.tie_word_embeddings
        self.lm_head = None if tied else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.splits = torch.get_num_threads()

    def forward(self, input_ids, positions, kv_caches, metas) -> torch.Tensor:
        """Hidden states [T, hidden] of the new tokens."""
        return self.model(input_ids, positions, kv_caches, metas)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of each row of `hidden` (in an engine step, a quantized head computes them with the
        decode numerics however many they are: quant.linear.decode_numerics)."""
        if self.lm_head is None:
            return linear(hidden, self.model.embed_tokens.weight, splits=self.splits)
        return self.lm_head(hidden)
