"""The tensors of a GGUF file under their Hugging Face names, dequantized one at a time."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor

from llmpipe.config import ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.gguf_file import tensor_shape
from llmpipe.loader.gguf_names import GGUFArchitecture, pattern_of, unpermute_rows
from llmpipe.loader.gguf_quants import SUPPORTED_TYPES, dequantize


class GGUFWeights:
    """A WeightSource over a parsed GGUF; `raw_blocks` gives quantized data for repacking."""

    def __init__(self, reader: GGUFReader, path: Path, arch: GGUFArchitecture, config: ModelConfig) -> None:
        self.path = path
        self.file_bytes = path.stat().st_size
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
        return self._unpermute(name, weight)

    def raw_blocks(self, name: str) -> tuple[GGMLQuantizationType, torch.Tensor]:
        """(type, data) without dequantizing: for block types, uint8 [rows, bytes per row]."""
        tensor = self._tensors[name]
        return tensor.tensor_type, self._unpermute(name, torch.from_numpy(tensor.data))

    def _unpermute(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        heads = self._heads.get(name)
        return rows if heads is None else unpermute_rows(rows, heads)
