"""What a proposer returns, and the interface the engine calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from llmpipe.engine.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[int]
    # [len(token_ids), vocab]: the distribution each token was drawn from. None: a deterministic
    # guess (n-gram lookup, or a greedy draft), i.e. a point mass on each token.
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> dict[Sequence, Proposal]:
        """Up to limits[i] tokens to follow each sequence's last token; sequences without a guess are left out."""

    def prefill(self, seqs: list[Sequence]) -> None:
        """seqs just finished their prompt on the target: a proposer with a cache of its own fills it
        now, so the cost lands before the first token (in TTFT) rather than inside decode."""

    def release(self, seq: Sequence) -> None:
        """seq is finished or aborted: drop whatever the proposer keeps for it."""
