"""Configuration: what the checkpoint is (ModelConfig) and how the engine runs it (EngineConfig)."""

from __future__ import annotations

import dataclasses
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
    def kv_bytes_per_token_per_element(self) -> int:
        """K and V entries stored per token: 2 × layers × kv_heads × head_dim."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """Every engine option, named like its CLI flag in snake_case. Derived values are filled at load."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # default: the model's context length
    kv_cache: bool = True  # False recomputes the whole sequence every step (for the benchmark)
    compile: bool = False  # torch.compile the decode step
    num_threads: int | None = None
    seed: int = 0
    # Filled from the checkpoint at load time.
    model_config: ModelConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError(f"max_model_len must be >= 1, got {self.max_model_len}")

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
