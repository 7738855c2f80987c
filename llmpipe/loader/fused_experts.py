"""A Hugging Face directory whose experts are 3-D tensors, read under per-expert names.

transformers keeps a layer's experts as `mlp.experts.gate_up_proj` [experts, 2 × inner, hidden] (each expert's
gate rows, then its up rows) and `mlp.experts.down_proj` [experts, hidden, inner]; Qwen's own Qwen3.5-MoE
checkpoints store them so (no `.weight` suffix), while `save_pretrained` writes one `gate_proj` / `up_proj` /
`down_proj` per expert. Either is read here under the per-expert names, each expert's slice read alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmpipe.loader.hf_weights import SafetensorsWeights

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(\.weight)?$")


@dataclass(frozen=True)
class ExpertRows:
    source: str  # the checkpoint's 3-D tensor
    expert: int
    rows: slice  # of that expert's [out, in] matrix


class FusedExpertWeights(SafetensorsWeights):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self._slices: dict[str, ExpertRows] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in super().shapes().items():
            match = _FUSED.match(name) if len(shape) == 3 else None
            if match is None:
                self._shapes[name] = shape
                continue
            prefix, projection, _ = match.groups()
            for e in range(shape[0]):
                for part, rows in _parts(projection, shape[1]):
                    self._slices[f"{prefix}.{e}.{part}.weight"] = ExpertRows(name, e, rows)
                    self._shapes[f"{prefix}.{e}.{part}.weight"] = (len(range(shape[1])[rows]), shape[2])

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def check_readable(self, names: Iterable[str]) -> None:
        super().check_readable(dict.fromkeys(self._slices[n].source if n in self._slices else n for n in names))

    def read(self, name: str) -> torch.Tensor:
        piece = self._slices.get(name)
        if piece is None:
            return super().read(name)
        return self._handles[piece.source].get_slice(piece.source)[piece.expert][piece.rows].contiguous()


def _parts(projection: str, rows: int) -> tuple[tuple[str, slice], ...]:
    if projection == "down_proj":
        return (("down_proj", slice(None)),)
    return ("gate_proj", slice(0, rows // 2)), ("up_proj", slice(rows // 2, None))
