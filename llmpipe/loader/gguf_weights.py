"""The tensors of a GGUF file under their Hugging Face names, dequantized one at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor

from llmpipe.config import ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.gguf_file import tensor_shape
from llmpipe.loader.gguf_names import GGUFArchitecture, pattern_of, unpermute_rows
from llmpipe.loader.gguf_quants import (SUPPORTED_TYPES, dequantize, split_iq4_nl, split_iq4_xs, split_q3_k,
                                        split_q4_0, split_q4_1, split_q4_k, split_q6_k, split_q8_0, unpack_nibbles)
from llmpipe.quant.formats import Int4Weight, Int8Weight, Q5_0Weight, QuantizedWeight

GGML_BLOCK = 32  # weights per Q4_0 / Q4_1 / Q5_0 / Q8_0 / IQ4_NL block, per Q4_K / IQ4_XS sub-block
K_SUB_BLOCK = 16  # weights per Q3_K / Q6_K sub-block
# The ggml types that are llmpipe weight formats exactly (read_quantized): the kernels run them on
# their codes. Q5_0 stays the file's blocks (unpacked a row at a time in the kernels); Q6_K's 6-bit codes
# ride in int8 (1.25 bytes a weight where the file has 0.82), as do Q3_K's −4..3 (1.25 where it has 0.43)
# and IQ4_NL / IQ4_XS's codebook values (1.125 where it has 0.56 / 0.53). Q2_K and Q5_1 are dequantized:
# their offsets need int4 groups of 16 (the INT4 kernels take multiples of 32) or 5-bit codes.
NATIVE_FORMATS = {
    GGMLQuantizationType.Q4_0: ("int4", GGML_BLOCK),
    GGMLQuantizationType.Q4_1: ("int4", GGML_BLOCK),
    GGMLQuantizationType.Q4_K: ("int4", GGML_BLOCK),
    GGMLQuantizationType.Q5_0: ("q5_0", GGML_BLOCK),
    GGMLQuantizationType.Q3_K: ("int8", K_SUB_BLOCK),
    GGMLQuantizationType.Q6_K: ("int8", K_SUB_BLOCK),
    GGMLQuantizationType.Q8_0: ("int8", GGML_BLOCK),
    GGMLQuantizationType.IQ4_NL: ("int8", GGML_BLOCK),
    GGMLQuantizationType.IQ4_XS: ("int8", GGML_BLOCK),
}
# Types held as int8 codes with float32 sub-block scales: (codes, scales) of [n blocks, type size] bytes.
INT8_SPLITS = {
    GGMLQuantizationType.Q3_K: split_q3_k,
    GGMLQuantizationType.Q6_K: split_q6_k,
    GGMLQuantizationType.IQ4_NL: split_iq4_nl,
    GGMLQuantizationType.IQ4_XS: split_iq4_xs,
}
# Rows converted at a time: a tensor's conversion temporaries (unpacked nibbles, strided copies) stay
# this many bytes of the file or so, not a whole embedding's worth.
CHUNK_BYTES = 16 << 20


class GGUFWeights:
    """A WeightSource over a parsed GGUF; `raw_blocks` gives quantized data for repacking."""

    def __init__(self, reader: GGUFReader, path: Path, arch: GGUFArchitecture, config: ModelConfig) -> None:
        self.path = path
        self._reader = reader
        self.file_bytes = path.stat().st_size
        self._shift_norms = arch.norms_store_one_plus_weight
        self._tensors: dict[str, ReaderTensor] = {}
        self._heads: dict[str, int] = {}  # HF name → head count, for rows llama.cpp permuted
        for tensor in reader.tensors:
            hf_name = arch.hf_name(tensor.name)
            if hf_name is None:
                continue
            self._tensors[hf_name] = tensor
            head_field = arch.permuted.get(pattern_of(tensor.name)[0])
            if head_field is not None:
                self._heads[hf_name] = getattr(config, head_field)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tensor_shape(t) for name, t in self._tensors.items()}

    def check_readable(self, names: Iterable[str]) -> None:
        for name in names:
            tensor = self._tensors[name]
            if tensor.tensor_type not in SUPPORTED_TYPES:
                supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
                raise UnsupportedModelError(
                    f"{self.path}: tensor {tensor.name} has type {tensor.tensor_type.name}, "
                    f"which llmpipe cannot dequantize (supported: {supported})"
                )

    def read(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        weight = dequantize(torch.from_numpy(tensor.data), tensor.tensor_type, tensor_shape(tensor))
        if self._shift_norms and name.endswith("norm.weight"):
            weight = weight - 1
        return self._unpermute(name, weight)

    def native_format(self, name: str) -> tuple[str, int | None] | None:
        """The llmpipe weight format a tensor maps onto without a float round trip, if any."""
        return NATIVE_FORMATS.get(self._tensors[name].tensor_type)

    def read_quantized(self, name: str) -> QuantizedWeight:
        """A tensor of a NATIVE_FORMATS type in llmpipe's formats, exactly (see `native_weight`)."""
        return native_weight(*self.raw_blocks(name))

    def raw_blocks(self, name: str) -> tuple[GGMLQuantizationType, torch.Tensor]:
        """(type, data) without dequantizing: for block types, uint8 [rows, bytes per row]."""
        tensor = self._tensors[name]
        return tensor.tensor_type, self._unpermute(name, torch.from_numpy(tensor.data))

    def release_pages(self, name: str) -> None:
        """Drop the file pages of a tensor already copied into the model from this process's RSS."""
        release = getattr(self._reader, "release_pages", None)
        if release is not None:
            release(self._tensors[name])

    def _unpermute(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        heads = self._heads.get(name)
        return rows if heads is None else unpermute_rows(rows, heads)


def native_weight(qtype: GGMLQuantizationType, rows: torch.Tensor) -> QuantizedWeight:
    """`convert_rows` over row chunks of about CHUNK_BYTES, written into one weight: the whole tensor
    exists once, in llmpipe's format, never as a full-size temporary of an intermediate form."""
    step = max(1, CHUNK_BYTES // max(1, rows[:1].numel()))
    if rows.shape[0] <= step:
        return convert_rows(qtype, rows)
    first = convert_rows(qtype, rows[:step])
    whole = {f.name: _rows_like(getattr(first, f.name), rows.shape[0]) for f in dataclasses.fields(first)}
    weight = dataclasses.replace(first, **whole)
    for start in range(0, rows.shape[0], step):
        part = first if start == 0 else convert_rows(qtype, rows[start : start + step])
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if isinstance(value, torch.Tensor):
                getattr(weight, f.name)[start : start + value.shape[0]].copy_(value)
    return weight


def _rows_like(value: object, rows: int) -> object:
    """An empty tensor like `value` with `rows` rows; other fields (group size) as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty((rows, *value.shape[1:]), dtype=value.dtype)


def convert_rows(qtype: GGMLQuantizationType, rows: torch.Tensor) -> QuantizedWeight:
    """uint8 [out, bytes per row] of a NATIVE_FORMATS type → the weight whose `dequantize()` is
    ggml's, bit for bit: Q4_1's (d, m) are (scale, offset); Q4_0's d·(q − 8) is scale d, offset −8d;
    Q4_K's sub-blocks are int4 groups of 32 (scale d·scale, offset −dmin·min); Q8_0's d·q is int8 with
    group-32 scales, Q6_K's d·scale·(q − 32) and Q3_K's d·(scale − 32)·q int8 with group-16 ones, IQ4_NL's
    d·kvalue and IQ4_XS's d·(scale − 32)·kvalue int8 with group-32 ones (the scale a float32 product, as
    ggml's); Q5_0 keeps its blocks."""
    out = rows.shape[0]
    if qtype == GGMLQuantizationType.Q5_0:
        return Q5_0Weight(rows.reshape(out, -1).contiguous())
    blocks = rows.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if qtype in INT8_SPLITS:
        scale, q = INT8_SPLITS[qtype](blocks)
        return Int8Weight(q.reshape(out, -1), scale.reshape(out, -1), NATIVE_FORMATS[qtype][1])
    if qtype == GGMLQuantizationType.Q8_0:
        scale, q = split_q8_0(blocks)
        return Int8Weight(q.reshape(out, -1), scale.float().reshape(out, -1), GGML_BLOCK)
    if qtype == GGMLQuantizationType.Q4_K:
        scale, offset, q = split_q4_k(blocks)
    elif qtype == GGMLQuantizationType.Q4_1:
        scale, offset, packed = split_q4_1(blocks)
        scale, offset, q = scale.float(), offset.float(), unpack_nibbles(packed)
    else:
        scale, packed = split_q4_0(blocks)
        scale, q = scale.float(), unpack_nibbles(packed)
        offset = scale * -8
    return Int4Weight(q.reshape(out, -1), scale.reshape(out, -1), offset.reshape(out, -1), GGML_BLOCK)
