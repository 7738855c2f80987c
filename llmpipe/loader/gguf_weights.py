"""The tensors of a GGUF file under their Hugging Face names, dequantized one at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor

from llmpipe.config import ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.gguf_file import tensor_shape
from llmpipe.loader.gguf_names import FUSED_EXPERTS, GGUFArchitecture, converter_fusions, pattern_of, unpermute_rows
from llmpipe.loader.gguf_quants import SUPPORTED_TYPES, dequantize
from llmpipe.models.weights import EMBED
from llmpipe.quant.apply import GGML_FORMAT
from llmpipe.quant.formats import GGMLWeight

Q = GGMLQuantizationType
# The types the GGML kernels (kernels/csrc/ggml_rows.h) read as the file holds them: such a tensor is
# the file's mapping (or a copy of its rows where they had to be unpermuted), nothing converted, no more
# bytes than the file's.
GGML_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
              Q.F16, Q.BF16)
# The ggml types that load quantized (read_quantized) and the llmpipe format each takes.
NATIVE_FORMATS = {t: GGML_FORMAT for t in GGML_TYPES}


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
        # Tensors only looked up, a row a token (an embedding that is not also the LM head): not mapped ahead.
        self._looked_up: set[str] = set() if config.tie_word_embeddings else {EMBED}
        for tensor in split_fused(reader.tensors, arch, config):
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
        return None if self.native_format(name) is None else int(self._tensors[name].n_bytes)

    def read_quantized(self, name: str) -> GGMLWeight:
        """A tensor of a NATIVE_FORMATS type as its blocks (`native_weight`): the file's mapping itself, its pages
        read in now (`populate_pages`; an untied embedding's only into the page cache, its rows mapped as tokens
        look them up), unless rows had to be unpermuted."""
        qtype, rows = self.raw_blocks(name)
        weight = native_weight(qtype, rows)
        if name not in self._heads:
            self._in_place.add(name)
            populate = getattr(self._reader, "populate_pages", None)
            if populate is not None:
                populate(self._tensors[name], mapped=name not in self._looked_up)
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
    return [_part(tensor, f"{tensor.name}[{e}]", tensor.shape[:-1], e) for e in range(experts)]


def split_fused(tensors: Iterable[ReaderTensor], arch: GGUFArchitecture, config: ModelConfig) -> Iterable[ReaderTensor]:
    """The tensors, those of llama.cpp's optional fusions (gguf_names.converter_fusions) as the converter writes them
    without: attn_qkv's rows as attn_q, attn_k and attn_v (k's and v's the KV heads' width each, q's the rest: a
    gated q's too), and ffn_gate_up_exps as ffn_gate_exps and ffn_up_exps (each expert's first and second half of
    rows). Views of the same mapping."""
    tensors = list(tensors)
    fused = converter_fusions([t.name for t in tensors], arch)
    for tensor in tensors:
        if tensor.name not in fused:
            yield tensor
            continue
        shape = tensor.shape.copy()  # ggml's order: rows (or, for experts, each expert's rows) second-to-last
        if pattern_of(tensor.name)[0] == FUSED_EXPERTS:
            shape[1] //= 2
            for h, part in enumerate(("gate", "up")):
                rows = slice(h * int(shape[1]), (h + 1) * int(shape[1]))
                yield _part(tensor, tensor.name.replace("gate_up", part), shape, (slice(None), rows))
            continue
        kv = config.num_key_value_heads * config.head_dim
        sizes = {"q": int(tensor.shape[-1]) - 2 * kv, "k": kv, "v": kv}
        start = 0
        for part, size in sizes.items():
            shape[-1] = size
            yield _part(tensor, tensor.name.replace("attn_qkv", f"attn_{part}"), shape.copy(), slice(start, start + size))
            start += size


def _part(tensor: ReaderTensor, name: str, shape: np.ndarray, index: object) -> ReaderTensor:
    """tensor.data[index] (a view) as a tensor of its own, `shape` in ggml's order, at its own bytes of the file."""
    data = tensor.data[index]
    offset = data.__array_interface__["data"][0] - tensor.data.__array_interface__["data"][0]
    return tensor._replace(name=name, shape=shape, n_elements=int(np.prod(shape)), n_bytes=int(data.nbytes),
                           data_offset=tensor.data_offset + offset, data=data)


def native_weight(qtype: GGMLQuantizationType, rows: torch.Tensor) -> GGMLWeight:
    """[out, bytes per row] of a GGML type (uint8; F16's float16 [out, in]) → the weight the GGML kernels read: the
    rows' bytes as they are, whose `dequantize()` is ggml's, bit for bit."""
    return GGMLWeight(int(qtype), rows.view(torch.uint8).reshape(rows.shape[0], -1))
