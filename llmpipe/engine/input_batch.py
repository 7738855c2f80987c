"""InputBatch: the sampling parameters of the sequences in flight as tensors, one slot per sequence,
written once when the sequence is first sampled and freed when it is released (vLLM's InputBatch).
A step gathers its rows' slots instead of rebuilding each parameter from every sequence."""

from __future__ import annotations

import torch

from llmpipe.engine.sequence import Sequence
from llmpipe.layers.sampler import SamplingTensors


class InputBatch:
    def __init__(self, capacity: int = 64):
        self.tensors = SamplingTensors.empty(capacity)
        self.slots: dict[Sequence, int] = {}
        self.free = list(range(capacity - 1, -1, -1))  # popped lowest first

    def sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """The rows of `seqs`, in order (a sequence seen for the first time joins)."""
        rows = torch.tensor([self._slot(seq) for seq in seqs], dtype=torch.long)  # may grow self.tensors
        return self.tensors.take(rows)

    def release(self, seq: Sequence) -> None:
        slot = self.slots.pop(seq, None)
        if slot is not None:
            self.free.append(slot)

    def _slot(self, seq: Sequence) -> int:
        slot = self.slots.get(seq)
        if slot is None:
            if not self.free:
                self._grow()
            slot = self.slots[seq] = self.free.pop()
            self.tensors.write(slot, seq.params)
        return slot

    def _grow(self) -> None:
        old = len(self.tensors.greedy)
        grown = SamplingTensors.empty(2 * old)
        for new, column in zip(grown.columns, self.tensors.columns):
            new[:old] = column
        self.tensors, self.free = grown, list(range(2 * old - 1, old - 1, -1))
