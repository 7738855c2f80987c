"""N-gram (prompt lookup) proposer: find the latest earlier occurrence of the sequence's last n
tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose what followed it. Free to
run, and strong wherever the output copies the input: rewriting, summarizing, editing code."""

from __future__ import annotations

import numpy as np

from llmpipe.engine.sequence import Sequence
from llmpipe.spec.proposal import Proposal


def ngram_continuation(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest matching suffix."""
    if k < 1:
        return []
    array = np.asarray(tokens)
    for n in range(min(max_n, len(array) - 1), min_n - 1, -1):
        # Windows that end before the last token, so each match has at least one token after it.
        windows = np.lib.stride_tricks.sliding_window_view(array[:-1], n)
        hits = np.flatnonzero((windows == array[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return array[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], limits: list[int]) -> dict[Sequence, Proposal]:
        proposals = {}
        for seq, k in zip(seqs, limits):
            tokens = ngram_continuation(seq.all_token_ids, k, self.min_n, self.max_n)
            if tokens:
                proposals[seq] = Proposal(tokens)
        return proposals

    def prefill(self, seqs: list[Sequence]) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass
