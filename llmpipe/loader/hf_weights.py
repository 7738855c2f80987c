"""The tensors of a Hugging Face directory: one model.safetensors, or shards listed in an index."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.files import read_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "F16", "BF16")
INTEGER_TABLES = (".tid2eid",)  # DeepSeek V4's token id → expert ids table
INTEGER_DTYPES = ("I64", "I32")


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no 'weight_map'")
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
    elif (directory / SINGLE_FILE).is_file():
        files = [directory / SINGLE_FILE]
    else:
        raise ModelLoadError(
            f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (llmpipe reads safetensors only, never pickles)"
        )
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file}: shard listed in {INDEX_FILE} is missing")
    return files


def _open(file: Path) -> Any:
    """safe_open validates the header and that the data fits the file (no tensor runs past EOF)."""
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{file}: not a valid safetensors file (corrupt or truncated?): {exc}") from exc


class SafetensorsWeights:
    """A WeightSource over memory-mapped safetensors files, kept open while the checkpoint lives."""

    def __init__(self, directory: Path) -> None:
        files = safetensors_files(directory)
        self.file_bytes = sum(f.stat().st_size for f in files)
        self._files: dict[str, Path] = {}
        self._handles: dict[str, Any] = {}
        for file in files:
            handle = _open(file)
            for name in handle.keys():
                self._files[name], self._handles[name] = file, handle

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(h.get_slice(name).get_shape()) for name, h in self._handles.items()}

    def check_readable(self, names: Iterable[str]) -> None:
        for name in names:
            dtype = self._handles[name].get_slice(name).get_dtype()
            if dtype not in FLOAT_DTYPES and not (name.endswith(INTEGER_TABLES) and dtype in INTEGER_DTYPES):
                raise UnsupportedModelError(
                    f"{self._files[name]}: tensor {name} has dtype {dtype}, "
                    f"expected one of {', '.join(FLOAT_DTYPES)}"
                )

    def read(self, name: str) -> torch.Tensor:
        try:
            return self._handles[name].get_tensor(name)
        except SafetensorError as exc:
            raise ModelLoadError(f"{self._files[name]}: cannot read tensor {name}: {exc}") from exc
