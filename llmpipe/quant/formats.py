"""Quantized weight formats, as plain tensors: what loaders produce and quantized layers consume.

Both formats quantize along the input dimension of a [out, in] weight, row by row, so rows of
different checkpoint tensors (q/k/v, gate/up) can be stacked without requantizing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QUANTIZATIONS = ("int8", "int4")
Q5_0_BLOCK = 32  # weights per GGUF Q5_0 block
Q5_0_BLOCK_BYTES = 22  # its float16 scale, 4 bytes of fifth bits, 16 of nibbles


@dataclass
class Int8Weight:
    """Symmetric: w[o, i] = q[o, i] * scale[o] (per output channel), or with `group_size` set
    * scale[o, i // group_size] (GGUF Q8_0: groups of 32)."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out] or [out, in // group_size]
    group_size: Optional[int] = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        if self.group_size is None:
            return self.q.float() * self.scale[:, None]
        return (self.q.float().unflatten(1, (-1, self.group_size)) * self.scale[..., None]).flatten(1)


@dataclass
class Int4Weight:
    """Group-wise asymmetric: w[o, i] = q[o, i] * scale[o, g] + offset[o, g], g = i // group_size.

    The scale + offset form (rather than (q - zero) * scale) represents GGUF Q4_1 blocks exactly
    (d, m) and GPTQ / AWQ ones too (offset = -zero * scale). `in_perm`, when set, is GPTQ act-order:
    column j of this weight is column in_perm[j] of the original, so groups stay contiguous here
    and the layer gathers its input columns in that order.
    """

    q: torch.Tensor  # uint8 [out, in], values 0..15 (unpacked; kernels pack as they need)
    # float32 [out, ceil(in / group_size)]: the last group may be narrower (SmolLM2's 576 at g128)
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int
    in_perm: Optional[torch.Tensor] = None  # int64 [in]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The float weight in the original column order."""
        in_features = self.q.shape[1]
        scale = self.scale.repeat_interleave(self.group_size, dim=1)[:, :in_features]
        offset = self.offset.repeat_interleave(self.group_size, dim=1)[:, :in_features]
        w = self.q.float() * scale + offset
        if self.in_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.in_perm] = w
        return out


@dataclass
class Q5_0Weight:
    """GGUF Q5_0, kept as the file's blocks: w = d * (q - 16) per block of 32 inputs (q 0..31). The kernels
    stream these bytes (0.69 a weight) and unpack each row for the INT8 row functions; `to_int8` is the
    same weight as int8 codes q - 16 with float32 group scales, exactly."""

    blocks: torch.Tensor  # uint8 [out, in / 32 * 22]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1] // Q5_0_BLOCK_BYTES * Q5_0_BLOCK))

    @property
    def group_size(self) -> int:
        return Q5_0_BLOCK

    @staticmethod
    def bytes_per_row(in_features: int) -> int:
        return in_features // Q5_0_BLOCK * Q5_0_BLOCK_BYTES

    def to_int8(self) -> Int8Weight:
        from llmpipe.loader.gguf_quants import split_q5_0  # the block layout lives with the other ggml types

        out = self.blocks.shape[0]
        scale, q = split_q5_0(self.blocks.reshape(-1, Q5_0_BLOCK_BYTES))
        return Int8Weight(q.reshape(out, -1), scale.float().reshape(out, -1), Q5_0_BLOCK)

    def dequantize(self) -> torch.Tensor:
        return self.to_int8().dequantize()


@dataclass
class GGMLWeight:
    """A GGUF tensor kept as the file's own blocks (`ggml_type`: ggml's type number, Q4_K's 12, ...; F16's and
    BF16's are its floats' bytes): the kernels (kernels/csrc/ggml_rows.h) read them in place, so the weight takes
    the file's bytes and no more; `dequantize` is gguf-py's, bit for bit (as float32)."""

    ggml_type: int
    blocks: torch.Tensor  # uint8 [out, in / block weights * block bytes]

    @property
    def shape(self) -> torch.Size:
        weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1] // nbytes * weights))

    @staticmethod
    def row_bytes(ggml_type: int, in_features: int) -> int:
        """Bytes of a row of `in_features` weights of `ggml_type`."""
        weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        return in_features // weights * nbytes

    @property
    def group_size(self) -> None:
        return None

    def dequantize(self) -> torch.Tensor:
        from llmpipe.loader.gguf_quants import dequantize  # the block layouts live with the loader

        return dequantize(self.blocks, GGMLQuantizationType(self.ggml_type), tuple(self.shape)).float()


QuantizedWeight = Int8Weight | Int4Weight | Q5_0Weight | GGMLWeight


def weight_bytes_per_param(quantization: Optional[str], dtype_bytes: int, group_size: int, in_features: int) -> float:
    """Resident bytes per weight element, scales included (what `llmpipe memory` plans with)."""
    if quantization is None:
        return float(dtype_bytes)
    if quantization == "int8":
        return 1 + 4 / in_features  # one float32 scale per output row
    if quantization == "int4":
        return 0.5 + 8 / group_size  # float32 scale and offset per group
    raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
