"""Phi-3's LongRoPE ("su"): each frequency divided by its own factor, from `short_factor` or `long_factor`.

transformers picks the list per forward from the sequence length: `long_factor` once
max(position) + 1 exceeds original_max_position_embeddings, `short_factor` before. With a KV
cache, a token is then rotated with the list in force when it is written, so this table does the
same per position: short below original_max_position_embeddings, long from there on. Sequences
that never pass the threshold match transformers exactly. Past it, transformers' `generate` also
drops its cache at the crossing step and re-encodes the whole sequence with the long factors;
llmpipe keeps the keys it cached (a paged, prefix-shared cache cannot be re-rotated per sequence),
as transformers' model does when stepped on its cache without `generate`.
"""

from __future__ import annotations


import torch

from llmpipe.layers.rotary import RotaryEmbedding


class LongRoPE(RotaryEmbedding):
    halves = 1  # the long/short factors differ across the whole head: its angles are computed whole

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        dim, s = self.head_dim, self.scaling
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        is_long = (positions >= s["original_max_position_embeddings"]).unsqueeze(1)
        factors = torch.where(is_long, torch.tensor(s["long_factor"], dtype=torch.float64),
                              torch.tensor(s["short_factor"], dtype=torch.float64))
        angles = positions.unsqueeze(1) * inv_freq / factors
        return torch.cat([angles, angles], dim=-1)

    def attention_factor(self) -> float:
        return self.scaling["attention_factor"]
