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

from typing import Any

import torch

from llmpipe.layers.rotary import RotaryEmbedding


class LongRoPE(RotaryEmbedding):
    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]):
        super().__init__(rotary_dim, max_positions, theta, scaling)

    def reset_tables(self) -> None:
        if self.cos.is_meta:
            return
        dim, s = self.head_dim, self.scaling
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        positions = torch.arange(self.max_positions, dtype=torch.float64)
        is_long = (positions >= s["original_max_position_embeddings"]).unsqueeze(1)
        factors = torch.where(is_long, torch.tensor(s["long_factor"], dtype=torch.float64),
                              torch.tensor(s["short_factor"], dtype=torch.float64))
        angles = positions.unsqueeze(1) * inv_freq / factors
        angles = torch.cat([angles, angles], dim=-1)
        scale, device = s["attention_factor"], self.cos.device
        self.cos = (angles.cos() * scale).float().to(device)
        self.sin = (angles.sin() * scale).float().to(device)
