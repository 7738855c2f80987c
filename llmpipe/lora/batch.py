"""One step's LoRA rows: which slot each row of the batch reads, grouped per adapter, and the grouped delta.

Multi-LoRA batching as punica / S-LoRA do it: the base layer runs once for the whole batch; then for each
adapter in the step, its rows' inputs are shrunk to its rank (x_rows @ A.T) and expanded back (@ B.T) and
added to those rows of the base output. The groups (a slice where an adapter's rows are contiguous, as they
are for a prefill chunk, else an index tensor) are built once per step and serve every module; a module
pays two small matmuls and an add per adapter, nothing per row. `reference_delta` is the same sum row by
row, the readable reference the grouped one is tested against.
"""

from __future__ import annotations

from typing import Sequence

import torch

from llmpipe.errors import LLMPipeError
from llmpipe.lora.adapter import LoRAFactors
from llmpipe.lora.slots import ModuleSlots

Rows = slice | torch.Tensor


class LoRABatch:
    def __init__(self, slot_of_row: Sequence[int | None], device: torch.device | str = "cpu"):
        self.rows = len(slot_of_row)
        self.slot_of_row = [-1 if slot is None else slot for slot in slot_of_row]  # as the fused decode step reads it
        members: dict[int, list[int]] = {}
        for row, slot in enumerate(slot_of_row):
            if slot is not None:
                members.setdefault(slot, []).append(row)
        self.groups: list[tuple[int, Rows]] = [(slot, _rows(rows, device)) for slot, rows in members.items()]

    @property
    def empty(self) -> bool:
        return not self.groups

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, slots: ModuleSlots) -> torch.Tensor:
        """y [rows, out] (a linear layer's output for x [rows, in]) plus each row's adapter's B @ A @ x, in place."""
        if x.shape[0] != self.rows:
            raise LLMPipeError(f"a LoRA step was set for {self.rows} rows, but a layer got {x.shape[0]}")
        for slot, rows in self.groups:
            w = slots.widths[slot]
            if not w:
                continue
            a, bt = slots.a[slot, :w], slots.bt[slot, :w]
            if isinstance(rows, slice):
                xs = x[rows] if x.dtype == a.dtype else x[rows].to(a.dtype)
                delta = (xs @ a.T) @ bt
                y[rows] += delta if y.dtype == delta.dtype else delta.to(y.dtype)
            else:
                xs = x.index_select(0, rows)
                delta = (xs if xs.dtype == a.dtype else xs.to(a.dtype)) @ a.T @ bt
                y.index_add_(0, rows, delta if y.dtype == delta.dtype else delta.to(y.dtype))
        return y


def _rows(rows: list[int], device: torch.device | str) -> Rows:
    if rows[-1] - rows[0] + 1 == len(rows):  # ascending by construction: contiguous means a slice
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.int64, device=device)


def reference_delta(x: torch.Tensor, row_factors: Sequence[LoRAFactors | None], out_features: int) -> torch.Tensor:
    """[rows, out]: row i's B @ (A @ x[i]) for its adapter's factors (zero where it has none), one row at a time."""
    delta = torch.zeros(x.shape[0], out_features, dtype=torch.float32)
    for i, factors in enumerate(row_factors):
        if factors is not None:
            delta[i] = factors.b.float() @ (factors.a.float() @ x[i].float())
    return delta
