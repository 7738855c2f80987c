"""A gpt-oss Hugging Face directory's tensors under per-expert names.

transformers keeps each layer's experts as 3-D tensors: `mlp.experts.gate_up_proj` [experts, hidden,
2 × inner] (input-major, gate and up columns interleaved), `down_proj` [experts, inner, hidden], and their
biases [experts, …]. OpenAI's release stores the two weights as MXFP4 instead (`*_blocks` uint8
[experts, out, in / 32, 16] and `*_scales` uint8 [experts, out, in / 32]: E2M1 codes, one E8M0 exponent per
32, rows output-major). Either is read here (`FusedExpertWeights`) as expert e's own `gate_proj`, `up_proj` and
`down_proj` (weight [out, in] and bias), as Qwen3-MoE's checkpoints name them. An MXFP4 weight loads as ggml's
MXFP4 blocks (the same codes and exponents, nibbles reordered: `mxfp4_from_hf`), read by the GGML kernels as a
GGUF's are; `read` dequantizes it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from gguf import GGMLQuantizationType

from llmpipe.errors import ModelLoadError
from llmpipe.loader.fused_experts import ExpertLayout, FusedExpertWeights
from llmpipe.loader.gguf_quants import mxfp4_from_hf
from llmpipe.quant.apply import GGML_FORMAT
from llmpipe.quant.formats import GGMLWeight


class GptOssSafetensorsWeights(FusedExpertWeights):
    layout = ExpertLayout({"": "weight", "_bias": "bias", "_blocks": "mxfp4"}, interleaved=True, transposed=True,
                          hidden=("_scales",))

    def _expert_shape(self, shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
        if kind == "bias":  # [experts, out]
            return (shape[1],)
        if kind == "mxfp4":  # blocks [experts, out, in / 32, 16]
            return shape[1], shape[2] * 32
        return super()._expert_shape(shape, kind)

    def _mxfp4(self, name: str) -> bool:
        piece = self._slices.get(name)
        return piece is not None and piece.kind == "mxfp4"

    def check_readable(self, names: Iterable[str]) -> None:
        names = list(names)
        super().check_readable(name for name in names if not self._mxfp4(name))
        for blocks in sorted({self._slices[name].source for name in names if self._mxfp4(name)}):
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
        return GGML_FORMAT if self._mxfp4(name) else None

    def read(self, name: str) -> torch.Tensor:
        return self.read_quantized(name).dequantize() if self._mxfp4(name) else super().read(name)

    def read_quantized(self, name: str) -> GGMLWeight:
        piece = self._slices[name]
        blocks = self._handles[piece.source].get_slice(piece.source)[piece.expert][piece.rows]
        scales_name = piece.source.removesuffix("_blocks") + "_scales"
        scales = self._handles[scales_name].get_slice(scales_name)[piece.expert][piece.rows]
        return GGMLWeight(int(GGMLQuantizationType.MXFP4), mxfp4_from_hf(blocks, scales).reshape(blocks.shape[0], -1))
