"""The tensors of a GGUF file under their Hugging Face names, dequantized one at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor

from llmpipe.config import ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.gguf_file import tensor_shape
from llmpipe.loader.gguf_names import GGUFArchitecture, pattern_of, unpermute_rows
from llmpipe.loader.gguf_quants import SUPPORTED_TYPES, dequantize, split_q3_k
from llmpipe.quant.apply import GGML_FORMAT
from llmpipe.quant.formats import GGMLWeight, Int8Weight, QuantizedWeight

K_SUB_BLOCK = 16  # weights per Q3_K sub-block
Q = GGMLQuantizationType
# The types the GGML kernels (kernels/csrc/ggml_rows.h) read as the file holds them: such a tensor is
# copied into its layer as it is, nothing converted, no more bytes than the file's.
GGML_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4)
# The ggml types that load quantized (read_quantized) and the llmpipe format each takes: the GGML types
# as themselves; Q3_K as int8 codes −4..3 with group-16 float32 scales (1.25 bytes a weight where the file
# has 0.43). Q2_K is dequantized.
NATIVE_FORMATS = {**{t: GGML_FORMAT for t in GGML_TYPES}, Q.Q3_K: ("int8", K_SUB_BLOCK)}
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
        self._in_place: set[str] = set()  # tensors handed out as views of the mapping: their pages stay
        self._values: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}  # HF name → arch.values' function
        for tensor in reader.tensors:
            expert_names = arch.expert_names(tensor.name, int(tensor.shape[-1])) if len(tensor.shape) > 1 else None
            if expert_names is not None:
                self._tensors |= dict(zip(expert_names, expert_slices(tensor)))
                continue
            hf_name = arch.hf_name(tensor.name)
            if hf_name is None:
                continue
            self._tensors[hf_name] = tensor
            if (value := arch.value_of(tensor.name)) is not None:
                self._values[hf_name] = value
            head_field = arch.permuted.get(pattern_of(tensor.name)[0])
            if head_field is not None:
                self._heads[hf_name] = getattr(config, head_field)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self._shape(name, t) for name, t in self._tensors.items()}

    def _shape(self, name: str, tensor: ReaderTensor) -> tuple[int, ...]:
        shape = tensor_shape(tensor)
        value = self._values.get(name)
        return shape if value is None else tuple(value(torch.empty(shape, device="meta")).shape)

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
        if name in self._values:
            weight = self._values[name](weight.float())
        return self._unpermute(name, weight)

    def native_format(self, name: str) -> tuple[str, int | None] | None:
        """The llmpipe weight format a tensor maps onto without a float round trip, if any (none where its values
        are transformed)."""
        return None if name in self._values else NATIVE_FORMATS.get(self._tensors[name].tensor_type)

    def stored_bytes(self, name: str) -> int | None:
        """Resident bytes of a tensor loaded in its NATIVE_FORMATS format (None: it loads dequantized)."""
        tensor, fmt = self._tensors[name], self.native_format(name)
        if fmt is None:
            return None
        if fmt == GGML_FORMAT:
            return int(tensor.n_bytes)
        return int(tensor.n_elements) + int(tensor.n_elements) // K_SUB_BLOCK * 4  # int8 codes, a float32 scale each 16

    def read_quantized(self, name: str) -> QuantizedWeight:
        """A tensor of a NATIVE_FORMATS type in llmpipe's formats, exactly (see `native_weight`). A GGML type's
        blocks are the file's mapping itself, its pages read in now (`populate_pages`), unless rows had to be
        unpermuted."""
        qtype, rows = self.raw_blocks(name)
        weight = native_weight(qtype, rows)
        if isinstance(weight, GGMLWeight) and name not in self._heads:
            self._in_place.add(name)
            populate = getattr(self._reader, "populate_pages", None)
            if populate is not None:
                populate(self._tensors[name])
        return weight

    def raw_blocks(self, name: str) -> tuple[GGMLQuantizationType, torch.Tensor]:
        """(type, data) without dequantizing: for block types, uint8 [rows, bytes per row]."""
        tensor = self._tensors[name]
        return tensor.tensor_type, self._unpermute(name, torch.from_numpy(tensor.data))

    def release_pages(self, name: str) -> None:
        """Drop the file pages of a tensor already copied into the model from this process's RSS (not of one
        the model holds as a view of the mapping)."""
        release = getattr(self._reader, "release_pages", None)
        if release is not None and name not in self._in_place:
            release(self._tensors[name])

    def _unpermute(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        heads = self._heads.get(name)
        return rows if heads is None else unpermute_rows(rows, heads)


def expert_slices(tensor: ReaderTensor) -> list[ReaderTensor]:
    """An experts tensor's experts (3-D weights; 2-D biases, gpt-oss's), each a tensor of its own: its slice of
    the data (a view of the same mapping, rows of whole blocks) and of the file."""
    experts = int(tensor.shape[-1])
    n_bytes, n_elements = int(tensor.n_bytes) // experts, int(tensor.n_elements) // experts
    return [tensor._replace(name=f"{tensor.name}[{e}]", shape=tensor.shape[:-1], n_elements=n_elements, n_bytes=n_bytes,
                            data_offset=tensor.data_offset + e * n_bytes, data=tensor.data[e]) for e in range(experts)]


def native_weight(qtype: GGMLQuantizationType, rows: torch.Tensor) -> QuantizedWeight:
    """`convert_rows` over row chunks of about CHUNK_BYTES, written into one weight: the whole tensor
    exists once, in llmpipe's format, never as a full-size temporary of an intermediate form."""
    step = max(1, CHUNK_BYTES // max(1, rows[:1].numel()))
    if rows.shape[0] <= step or qtype in GGML_TYPES:
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
    """uint8 [out, bytes per row] of a NATIVE_FORMATS type → the weight whose `dequantize()` is ggml's, bit
    for bit: a GGML type's rows as they are; Q3_K's d·(scale − 32)·q as int8 codes with group-16 scales."""
    out = rows.shape[0]
    if qtype in GGML_TYPES:
        return GGMLWeight(int(qtype), rows.reshape(out, -1))
    scale, q = split_q3_k(rows.reshape(-1, GGML_QUANT_SIZES[qtype][1]))
    return Int8Weight(q.reshape(out, -1), scale.reshape(out, -1), K_SUB_BLOCK)
