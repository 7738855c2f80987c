"""Qwen3-Next's fused input projections read as Qwen3.5's four.

A Qwen3-Next linear layer projects with `in_proj_qkvz` and `in_proj_ba`, their rows grouped by key head: per key
head [q | k | v of its value heads | z of its value heads] and [b of its value heads | a of them] (transformers'
fix_query_key_value_ordering). Qwen3.5 keeps `in_proj_qkv` (all q, all k, all v), `in_proj_z`, `in_proj_b` and
`in_proj_a`, value heads in the same order: regrouping the rows turns one into the other, so both families load
into one mixer. A GGUF `qwen3next` holds `ssm_ba` (and, converted before llama.cpp split it, `ssm_in` for
in_proj_qkvz) as Hugging Face has them. Checkpoints already split pass as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from llmpipe.errors import ModelLoadError
from llmpipe.models.qwen3_5.config import Qwen35Fields
from llmpipe.quant.apply import GGML_FORMAT, WeightFormat
from llmpipe.quant.formats import GGMLWeight, QuantizedWeight

if TYPE_CHECKING:
    from llmpipe.loader.checkpoint import WeightSource

Rows = dict[str, torch.Tensor]  # a part's name suffix → its rows of the fused tensor


def fused_rows(f: Qwen35Fields) -> dict[str, Rows]:
    """Per fused tensor (name suffix), the rows of each of Qwen3.5's projections it holds."""
    heads, per_key = f.linear_num_key_heads, f.linear_num_value_heads // f.linear_num_key_heads
    sizes = [f.linear_key_head_dim] * 2 + [per_key * f.linear_value_head_dim] * 2  # per key head: q, k, its v, its z
    q, k, v, z = torch.arange(heads * sum(sizes)).view(heads, -1).split(sizes, 1)
    b, a = torch.arange(2 * f.linear_num_value_heads).view(heads, -1).split([per_key] * 2, 1)
    return {
        "in_proj_qkvz.weight": {"in_proj_qkv.weight": torch.cat([q.flatten(), k.flatten(), v.flatten()]),
                                "in_proj_z.weight": z.flatten()},
        "in_proj_ba.weight": {"in_proj_b.weight": b.flatten(), "in_proj_a.weight": a.flatten()},
    }


class SplitProjectionWeights:
    """A WeightSource with each fused projection read as its parts: rows of the stored tensor, float or, where the
    source keeps it as a GGUF's blocks, those rows' blocks."""

    def __init__(self, source: WeightSource, fields: Qwen35Fields) -> None:
        self.source, self.file_bytes = source, source.file_bytes
        self._parts: dict[str, tuple[str, torch.Tensor]] = {}  # part → (fused tensor, its rows)
        self._shapes = source.shapes()
        for name in self._shapes:
            for suffix, parts in fused_rows(fields).items():
                if name.endswith(suffix):
                    _check_rows(name, self._shapes[name], parts)
                    prefix = name.removesuffix(suffix)
                    self._parts |= {prefix + part: (name, rows) for part, rows in parts.items()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        fused = {name for name, _ in self._parts.values()}
        parts = {part: (len(rows), *self._shapes[name][1:]) for part, (name, rows) in self._parts.items()}
        return {name: shape for name, shape in self._shapes.items() if name not in fused} | parts

    def check_readable(self, names: Iterable[str]) -> None:
        self.source.check_readable(list(dict.fromkeys(self._stored(name) for name in names)))

    def read(self, name: str) -> torch.Tensor:
        if name not in self._parts:
            return self.source.read(name)
        fused, rows = self._parts[name]
        return self.source.read(fused)[rows]

    def native_format(self, name: str) -> WeightFormat | None:
        native = getattr(self.source, "native_format", None)
        fmt = None if native is None else native(self._stored(name))
        return fmt if name not in self._parts or fmt == GGML_FORMAT else None  # whole block rows regroup as they are

    def read_quantized(self, name: str) -> QuantizedWeight:
        if name not in self._parts:
            return self.source.read_quantized(name)
        fused, rows = self._parts[name]
        weight = self.source.read_quantized(fused)
        return GGMLWeight(weight.ggml_type, weight.blocks[rows])

    def stored_bytes(self, name: str) -> int | None:
        stored = getattr(self.source, "stored_bytes", lambda name: None)(self._stored(name))
        if stored is None or name not in self._parts:
            return stored
        fused, rows = self._parts[name]
        return stored * len(rows) // self._shapes[fused][0]

    def release_pages(self, name: str) -> None:
        getattr(self.source, "release_pages", lambda name: None)(self._stored(name))

    def _stored(self, name: str) -> str:
        return self._parts[name][0] if name in self._parts else name


def _check_rows(name: str, shape: tuple[int, ...], parts: Rows) -> None:
    rows = sum(len(r) for r in parts.values())
    if shape[0] != rows:
        raise ModelLoadError(f"tensor {name} has {shape[0]} rows, the config's linear-attention heads give {rows}")
