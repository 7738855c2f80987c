"""Configuration: what the checkpoint is (ModelConfig) and how the engine runs it (EngineConfig)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from llmpipe.errors import InvalidRequestError

# Architectures served by models/llama.py (Hugging Face `model_type` / GGUF `general.architecture`).
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    """Architecture-neutral hyperparameters, filled by the loaders from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Hugging Face `rope_scaling` dict ({"rope_type": "llama3", "factor": ..., ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral-style window; None = full attention
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_elements_per_token(self) -> int:
        """K and V entries stored per token: 2 × layers × kv_heads × head_dim."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | float | str) -> int:
    """1073741824, 1.5e9, "512MiB", "2GiB", "4GB" → bytes."""
    if isinstance(value, (int, float)):
        number, unit = value, ""
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise InvalidRequestError(f"kv_cache_memory must be bytes or a size like '2GiB', got {value!r}")
        number, unit = float(match.group(1)), match.group(2)
    size = int(float(number) * _UNITS[unit.lower()])
    if size <= 0:
        raise InvalidRequestError(f"kv_cache_memory must be positive, got {value!r}")
    return size


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """Every engine option, named like its CLI flag in snake_case. Derived values are filled at load."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # default: the model's context length (capped by the KV pool)
    kv_cache: bool = True  # False recomputes the whole sequence every step (for the benchmark)
    kv_cache_memory: int | float | str = "1GiB"  # bytes, or a string like "512MiB" / "2GiB"
    max_num_blocks: int | None = None  # overrides kv_cache_memory
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    seed: int = 0
    # Filled from the checkpoint at load time.
    model_config: ModelConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_model_len", "max_num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls) if f.name != "model_config"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)
