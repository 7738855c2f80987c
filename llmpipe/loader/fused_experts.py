"""A Hugging Face directory whose experts are 3-D tensors, read under per-expert names.

transformers keeps a layer's experts as `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`, one tensor each
for all experts; `save_pretrained` writes one `gate_proj` / `up_proj` / `down_proj` per expert instead. Either is
read here under the per-expert names, each expert's slice read alone. An `ExpertLayout` says how a family packs
them; the default is Qwen's (Qwen3.5-MoE's own checkpoints, no `.weight` suffix): `gate_up_proj`
[experts, 2 × inner, hidden] (each expert's gate rows, then its up rows) and `down_proj` [experts, hidden, inner].
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from llmpipe.loader.hf_weights import SafetensorsWeights


@dataclass(frozen=True)
class ExpertLayout:
    """How a checkpoint packs each layer's experts into `{prefix}.mlp.experts.{gate_up_proj|down_proj}{ending}`."""

    endings: dict[str, str]  # the fused names' accepted endings → what they hold: "weight" (float) or a subclass's kind
    interleaved: bool  # gate and up as even / odd output features, else each expert's gate rows, then its up rows
    transposed: bool  # float weights stored [experts, in, out], else [experts, out, in]
    hidden: tuple[str, ...] = ()  # endings of tensors read only beside others, left out of shapes()

    def parts(self, projection: str, out: int) -> tuple[tuple[str, slice], ...]:
        """Each per-expert projection in `projection` and its rows of the expert's `out` output features."""
        if projection == "down_proj":
            return (("down_proj", slice(None)),)
        if self.interleaved:
            return ("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))
        return ("gate_proj", slice(0, out // 2)), ("up_proj", slice(out // 2, None))


@dataclass(frozen=True)
class ExpertRows:
    source: str  # the checkpoint's 3-D tensor
    expert: int
    rows: slice  # of that expert's output features
    kind: str  # what `source` holds: an `ExpertLayout.endings` value


class FusedExpertWeights(SafetensorsWeights):
    layout: ClassVar[ExpertLayout] = ExpertLayout({"": "weight", ".weight": "weight"}, interleaved=False, transposed=False)

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        endings = "|".join(map(re.escape, self.layout.endings))
        pattern = re.compile(rf"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)({endings})$")
        self._slices: dict[str, ExpertRows] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in super().shapes().items():
            match = pattern.match(name)
            kind = self.layout.endings[match[3]] if match else None
            if kind is None or (kind == "weight" and len(shape) != 3):
                if not name.endswith(self.layout.hidden):
                    self._shapes[name] = shape
                continue
            out, *rest = self._expert_shape(shape, kind)
            for e in range(shape[0]):
                for part, rows in self.layout.parts(match[2], out):
                    part_name = f"{match[1]}.{e}.{part}.{'bias' if kind == 'bias' else 'weight'}"
                    self._slices[part_name] = ExpertRows(name, e, rows, kind)
                    self._shapes[part_name] = (len(range(out)[rows]), *rest)

    def _expert_shape(self, shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
        """One expert's tensor of `kind` as read, output features first."""
        return (shape[2], shape[1]) if self.layout.transposed else shape[1:]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def check_readable(self, names: Iterable[str]) -> None:
        super().check_readable(dict.fromkeys(self._slices[n].source if n in self._slices else n for n in names))

    def read(self, name: str) -> torch.Tensor:
        piece = self._slices.get(name)
        if piece is None:
            return super().read(name)
        tensor = self._handles[piece.source].get_slice(piece.source)[piece.expert]
        return (tensor.T if self.layout.transposed and piece.kind == "weight" else tensor)[piece.rows].contiguous()
