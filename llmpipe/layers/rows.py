"""A step's rows computed a part at a time into one output: no list of parts and `torch.cat` beside it, so a large
step holds one [tokens, width] tensor fewer at its peak (the chunked MLP, a mixed step's attention)."""

from __future__ import annotations

from typing import Iterable

import torch


def row_slices(rows: int, most: int) -> list[slice]:
    """[0, rows) in near-equal parts of at most `most` rows, the larger first (as torch.tensor_split)."""
    parts = max(1, -(-rows // most))
    size, extra = divmod(rows, parts)
    starts = [i * size + min(i, extra) for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def stack_rows(rows: int, parts: Iterable[tuple[slice, torch.Tensor]]) -> torch.Tensor:
    """The output [rows, ...] whose rows at each slice are that part's (parts computed lazily, in turn: pass a
    generator); a first part that is every row is returned as it is."""
    out = None
    for where, y in parts:
        if out is None and y.shape[0] == rows:
            return y
        out = y.new_empty(rows, *y.shape[1:]) if out is None else out
        out[where] = y
    return out
