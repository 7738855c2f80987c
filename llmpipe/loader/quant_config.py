"""The `quantization_config` of a Hugging Face config.json: GPTQ or AWQ 4-bit, checked field by field, or
MXFP4 (gpt-oss's experts, whose layout is fixed).

The field names are those AutoGPTQ / AutoAWQ write and transformers' GPTQConfig / AwqConfig read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.files import read_json

METHODS = ("gptq", "awq", "mxfp4")


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # "gptq" | "awq" | "mxfp4"
    bits: int
    group_size: int  # -1: one group spanning each layer's whole input
    desc_act: bool = False  # GPTQ act-order: g_idx assigns input columns to groups out of order
    zero_offset: int = 0  # GPTQ "v1" checkpoints store zero − 1

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


def hf_quantization_config(directory: Path) -> QuantizationConfig | None:
    """The directory's quantization config, or None for an unquantized checkpoint."""
    config_path = directory / "config.json"
    raw = read_json(config_path).get("quantization_config")
    return None if raw is None else parse_quantization_config(raw, config_path)


def parse_quantization_config(raw: Any, path: Path) -> QuantizationConfig:
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: quantization_config must be a JSON object, got {raw!r}")

    def need(key: str, kind: type) -> Any:
        if key not in raw or raw[key] is None:
            raise ModelLoadError(f"{path}: quantization_config is missing {key!r}")
        if not isinstance(raw[key], kind) or isinstance(raw[key], bool):
            raise ModelLoadError(f"{path}: quantization_config {key!r} must be {kind.__name__}, got {raw[key]!r}")
        return raw[key]

    method = str(need("quant_method", str)).lower()
    if method == "mxfp4":  # gpt-oss's experts: E2M1 codes, one E8M0 exponent per 32 (models/gpt_oss/weights.py)
        return QuantizationConfig(method, 4, 32)
    if method not in METHODS:
        raise UnsupportedModelError(
            f"{path}: quant_method {method!r} is not supported (supported: {', '.join(METHODS)})"
        )
    bits, group_size = need("bits", int), need("group_size", int)
    if bits != 4:
        raise UnsupportedModelError(f"{path}: {method} with bits={bits} is not supported (only 4-bit)")
    if group_size != -1 and group_size < 1:
        raise ModelLoadError(f"{path}: quantization_config group_size must be positive or -1, got {group_size}")
    if method == "awq":
        return _awq(raw, path, bits, group_size)
    checkpoint_format = str(raw.get("checkpoint_format") or "gptq").lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(f"{path}: GPTQ checkpoint_format {checkpoint_format!r} is not supported")
    desc_act = bool(raw.get("desc_act", False))
    return QuantizationConfig("gptq", bits, group_size, desc_act, zero_offset=1 if checkpoint_format == "gptq" else 0)


def _awq(raw: dict[str, Any], path: Path, bits: int, group_size: int) -> QuantizationConfig:
    version = str(raw.get("version") or "gemm").lower()
    if version != "gemm":
        raise UnsupportedModelError(f"{path}: AWQ version {version!r} is not supported (only 'gemm')")
    if raw.get("zero_point", True) is not True:
        raise UnsupportedModelError(f"{path}: AWQ without zero points (zero_point={raw['zero_point']!r}) is not supported")
    return QuantizationConfig("awq", bits, group_size)
