"""A gpt-oss Hugging Face directory's tensors under per-expert names.

transformers keeps each layer's experts as 3-D tensors: `mlp.experts.gate_up_proj` [experts, hidden,
2 × inner] (input-major, gate and up columns interleaved), `down_proj` [experts, inner, hidden], and their
biases [experts, …]. OpenAI's release stores the two weights as MXFP4 instead (`*_blocks` uint8
[experts, out, in / 32, 16] and `*_scales` uint8 [experts, out, in / 32]: E2M1 codes, one E8M0 exponent per
32, rows output-major). Either is read here as expert e's own `gate_proj`, `up_proj` and `down_proj`
(weight [out, in] and bias), as Qwen3-MoE's checkpoints name them. An MXFP4 weight loads as ggml's MXFP4
blocks (the same codes and exponents, nibbles reordered: `mxfp4_from_hf`), read by the GGML kernels as a
GGUF's are; `read` dequantizes it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from llmpipe.errors import ModelLoadError
from llmpipe.loader.gguf_quants import mxfp4_from_hf
from llmpipe.loader.hf_weights import SafetensorsWeights
from llmpipe.quant.apply import GGML_FORMAT
from llmpipe.quant.formats import GGMLWeight

_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks)?$")
PROJECTIONS = {"gate_up_proj": (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))),
               "down_proj": (("down_proj", slice(None)),)}


@dataclass(frozen=True)
class ExpertSlice:
    source: str  # the checkpoint's 3-D tensor (`*_blocks` for MXFP4)
    expert: int
    rows: slice  # of the output features (gate: even, up: odd)
    kind: str  # "weight" (float [experts, in, out]), "bias" [experts, out] or "mxfp4" ([experts, out, …] blocks)


class GptOssSafetensorsWeights(SafetensorsWeights):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        base = super().shapes()
        self._slices: dict[str, ExpertSlice] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in base.items():
            match = _EXPERTS.match(name)
            if match is None:
                if not name.endswith("_scales"):
                    self._shapes[name] = shape
                continue
            prefix, projection, suffix = match.groups()
            kind = {None: "weight", "_bias": "bias", "_blocks": "mxfp4"}[suffix]
            for e in range(shape[0]):
                for part, rows in PROJECTIONS[projection]:
                    hf_name = f"{prefix}.{e}.{part}.{'bias' if kind == 'bias' else 'weight'}"
                    self._slices[hf_name] = ExpertSlice(name, e, rows, kind)
                    self._shapes[hf_name] = self._slice_shape(shape, rows, kind)

    @staticmethod
    def _slice_shape(shape: tuple[int, ...], rows: slice, kind: str) -> tuple[int, ...]:
        if kind == "weight":  # [experts, in, out]
            return len(range(shape[2])[rows]), shape[1]
        if kind == "bias":
            return (len(range(shape[1])[rows]),)
        return len(range(shape[1])[rows]), shape[2] * 32  # blocks [experts, out, in / 32, 16]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def check_readable(self, names: Iterable[str]) -> None:
        plain, sources, packed = [], set(), set()
        for name in names:
            piece = self._slices.get(name)
            if piece is None:
                plain.append(name)
            else:
                (packed if piece.kind == "mxfp4" else sources).add(piece.source)
        super().check_readable(plain + sorted(sources))
        for blocks in sorted(packed):
            self._check_mxfp4(blocks)

    def _check_mxfp4(self, blocks: str) -> None:
        """`blocks` uint8 [experts, out, in / 32, 16] beside its `_scales` uint8 [experts, out, in / 32]."""
        scales = blocks.removesuffix("_blocks") + "_scales"
        file = self._files[blocks]
        if scales not in self._handles:
            raise ModelLoadError(f"{file}: MXFP4 tensor {blocks} has no {scales}")
        shapes = {name: tuple(self._handles[name].get_slice(name).get_shape()) for name in (blocks, scales)}
        dtypes = {self._handles[name].get_slice(name).get_dtype() for name in (blocks, scales)}
        if dtypes != {"U8"} or len(shapes[blocks]) != 4 or shapes[blocks][3] != 16 or shapes[blocks][:3] != shapes[scales]:
            raise ModelLoadError(f"{file}: MXFP4 tensors {blocks} {list(shapes[blocks])} and {scales} {list(shapes[scales])} "
                                 f"must be uint8 [experts, out, in / 32, 16] and [experts, out, in / 32]")

    def native_format(self, name: str) -> tuple[str, None] | None:
        """MXFP4 experts load as ggml's MXFP4 blocks; every other tensor is float."""
        piece = self._slices.get(name)
        return GGML_FORMAT if piece is not None and piece.kind == "mxfp4" else None

    def read(self, name: str) -> torch.Tensor:
        piece = self._slices.get(name)
        if piece is None:
            return super().read(name)
        if piece.kind == "mxfp4":
            return self.read_quantized(name).dequantize()
        tensor = self._handles[piece.source].get_slice(piece.source)[piece.expert]
        return (tensor.T if piece.kind == "weight" else tensor)[piece.rows].contiguous()

    def read_quantized(self, name: str) -> GGMLWeight:
        piece = self._slices[name]
        blocks = self._handles[piece.source].get_slice(piece.source)[piece.expert][piece.rows]
        scales_name = piece.source.removesuffix("_blocks") + "_scales"
        scales = self._handles[scales_name].get_slice(scales_name)[piece.expert][piece.rows]
        return GGMLWeight(int(GGMLQuantizationType.MXFP4), mxfp4_from_hf(blocks, scales).reshape(blocks.shape[0], -1))
