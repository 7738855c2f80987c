"""The tensors of a GPTQ / AWQ directory: each quantized linear, stored as `qweight`, `qzeros`,
`scales` (and GPTQ's `g_idx`), appears under its float name `<prefix>.weight`.

read() dequantizes it; read_quantized() unpacks it into an Int4Weight (packing.py has the layouts).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from llmpipe.config import INT4_GROUP_SIZES
from llmpipe.errors import ModelLoadError
from llmpipe.loader.hf_weights import FLOAT_DTYPES, SafetensorsWeights
from llmpipe.loader.quant_config import QuantizationConfig
from llmpipe.quant.formats import Int4Weight
from llmpipe.quant.packing import PACK, unpack_awq, unpack_gptq

PARTS = ("qweight", "qzeros", "scales", "g_idx")
INT_DTYPES = ("I32",)


class QuantizedSafetensorsWeights(SafetensorsWeights):
    def __init__(self, directory: Path, quant: QuantizationConfig) -> None:
        super().__init__(directory)
        self.quant = quant
        self._quantized = {name.removesuffix(".qweight") for name in self._handles if name.endswith(".qweight")}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().shapes()
        for prefix in self._quantized:
            for part in PARTS:
                shapes.pop(f"{prefix}.{part}", None)
            shapes[f"{prefix}.weight"] = self._weight_shape(prefix)
        return shapes

    def check_readable(self, names: Iterable[str]) -> None:
        plain = []
        for name in names:
            prefix = name.removesuffix(".weight")
            if prefix in self._quantized:
                self._check_parts(prefix)
            else:
                plain.append(name)
        super().check_readable(plain)

    def native_format(self, name: str) -> tuple[str, int] | None:
        """("int4", group size) where the INT4 layers can hold the weight as stored; other group
        sizes load dequantized."""
        prefix = name.removesuffix(".weight")
        if prefix not in self._quantized:
            return None
        group = self.quant.group_for(self._weight_shape(prefix)[1])
        return ("int4", group) if group in INT4_GROUP_SIZES else None

    def read(self, name: str) -> torch.Tensor:
        if name.removesuffix(".weight") in self._quantized:
            return self.read_quantized(name).dequantize()
        return super().read(name)

    def read_quantized(self, name: str) -> Int4Weight:
        prefix = name.removesuffix(".weight")
        parts = {part: SafetensorsWeights.read(self, f"{prefix}.{part}") for part in self._parts(prefix)}
        group = self.quant.group_for(self._weight_shape(prefix)[1])
        try:
            if self.quant.method == "awq":
                return unpack_awq(parts["qweight"], parts["qzeros"], parts["scales"], group)
            return unpack_gptq(
                parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), group, self.quant.zero_offset
            )
        except ValueError as exc:
            raise ModelLoadError(f"{self._files[f'{prefix}.qweight']}: {prefix}: {exc}") from exc

    def _parts(self, prefix: str) -> tuple[str, ...]:
        """The tensors of one quantized linear: GPTQ's g_idx is required under act-order only."""
        gptq = self.quant.method == "gptq"
        has_g_idx = gptq and (self.quant.desc_act or f"{prefix}.g_idx" in self._handles)
        return PARTS if has_g_idx else PARTS[:3]

    def _weight_shape(self, prefix: str) -> tuple[int, int]:
        """(out, in) of the float weight, from qweight: GPTQ [in / 8, out], AWQ [in, out / 8]."""
        rows, cols = self._shape(f"{prefix}.qweight")
        return (cols, rows * PACK) if self.quant.method == "gptq" else (cols * PACK, rows)

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def _check_parts(self, prefix: str) -> None:
        """Every part present, with the dtype and shape the layout implies (one clear line if not)."""
        file = self._files[f"{prefix}.qweight"]
        if len(self._shape(f"{prefix}.qweight")) != 2:
            raise ModelLoadError(f"{file}: tensor {prefix}.qweight must be 2-D")
        out_features, in_features = self._weight_shape(prefix)
        groups = -(-in_features // self.quant.group_for(in_features))
        expected = {
            "qweight": (self._shape(f"{prefix}.qweight"), INT_DTYPES),
            "qzeros": ((groups, out_features // PACK), INT_DTYPES),
            "scales": ((groups, out_features), FLOAT_DTYPES),
            "g_idx": ((in_features,), ("I32", "I64")),
        }
        for part in self._parts(prefix):
            name = f"{prefix}.{part}"
            shape, dtypes = expected[part]
            if name not in self._handles:
                raise ModelLoadError(f"{file}: {self.quant.method} checkpoint is missing tensor {name}")
            dtype = self._handles[name].get_slice(name).get_dtype()
            if dtype not in dtypes:
                raise ModelLoadError(f"{file}: tensor {name} has dtype {dtype}, expected {' or '.join(dtypes)}")
            if self._shape(name) != shape:
                raise ModelLoadError(
                    f"{file}: tensor {name} has shape {list(self._shape(name))}, expected {list(shape)} "
                    f"({self.quant.method}, {self.quant.bits}-bit, group_size {self.quant.group_size})"
                )
