"""One LoRA adapter as plain data, whatever file it came from (lora/peft_adapter.py, lora/gguf_adapter.py).

A low-rank update of a linear layer W (out × in) is W + scale · B @ A with A (r × in) and B (out × r). The adapter
keeps, per llmpipe module, A and B with the scale folded into B. llmpipe stacks q/k/v into one qkv_proj and
gate/up into gate_up_proj, so a stacked module's factors are its shards' put side by side: A is the shards'
A's one under the other (ranks add up) and B is block-diagonal, each shard's B in its own rows and rank
columns; a shard the adapter leaves alone has no rank and its rows stay zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class LoRAFactors:
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank], the adapter's scale (alpha / r, or alpha / sqrt(r)) multiplied in

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def delta_weight(self) -> torch.Tensor:
        """B @ A: what merging the adapter adds to the module's weight."""
        return self.b @ self.a


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    rank: int  # the largest rank of any one checkpoint module (a shard of a stacked module) it adapts
    modules: dict[str, LoRAFactors]  # llmpipe module name (model.layers.3.self_attn.qkv_proj) → its factors
    path: Path | None = None
