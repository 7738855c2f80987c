"""Qwen3.5's own hyperparameters, from a config.json as transformers' Qwen3_5TextConfig writes it (`qwen3_5_text`),
or the text half of a multimodal Qwen3_5Config (`qwen3_5`: the text model's fields under `text_config`).

RoPE: `rope_parameters` holds, beside the base, the partial rotary factor (only the first quarter of each head's
channels turn, by default) and the multimodal RoPE sections; for text every section carries the same position, so
it is plain RoPE on the first `rotary_dim` channels and the sections are dropped here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.loader.hf_rope import hf_rope

PARTIAL_ROTARY_FACTOR = 0.25  # Qwen3_5TextConfig's default
FULL_ATTENTION_INTERVAL = 4  # its default layer pattern: every 4th layer full attention, the others linear
LAYER_TYPES = ("linear_attention", "full_attention")
MULTIMODAL_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
MULTIMODAL_TYPES = ("qwen3_5", "qwen3_5_moe")  # Qwen3_5(Moe)ForConditionalGeneration: the text model's under text_config
LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")


@dataclass(frozen=True)
class Qwen35Fields:
    """The linear-attention (Gated DeltaNet) layers' sizes and the full-attention layers' partial RoPE."""

    linear_num_key_heads: int
    linear_num_value_heads: int  # a multiple of the key heads: each key head serves a run of value heads
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    partial_rotary_factor: float
    # Value heads in llama.cpp's tiled order (a GGUF: its converter reorders them so that key head i serves value
    # heads i, i + K, ...), not grouped by key head as Hugging Face stores them. Only the key heads' expansion
    # depends on it: every other value-head tensor was permuted alike.
    v_heads_tiled: bool = False

    def rotary_dim(self, head_dim: int) -> int:
        """Channels RoPE turns at the start of each head (transformers truncates head_dim × factor)."""
        return int(head_dim * self.partial_rotary_factor)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: a multimodal config's `text_config` under its own model_type, with the
    top-level embedding tie (what transformers' ForConditionalGeneration ties by) and token ids it lacks."""
    if cfg["model_type"] not in MULTIMODAL_TYPES:
        return cfg
    tokens = {key: cfg[key] for key in ("bos_token_id", "eos_token_id") if key in cfg}
    return {**tokens, **cfg.get("text_config", {}), "model_type": cfg["model_type"],
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False))}


def qwen35_hf_fields(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The ModelConfig fields Qwen3.5 sets itself, from its (text) config."""
    missing = [key for key in LINEAR_FIELDS if cfg.get(key) is None]
    if missing:
        raise ModelLoadError(f"{path}: a qwen3_5 config needs {', '.join(missing)}")
    rope = {**cfg, "rope_parameters": {k: v for k, v in (cfg.get("rope_parameters") or {}).items()
                                       if k not in MULTIMODAL_ROPE_KEYS}}
    rope_theta, rope_scaling = hf_rope(rope)
    fields = Qwen35Fields(*(int(cfg[key]) for key in LINEAR_FIELDS), _partial_rotary_factor(cfg))
    return dict(rope_theta=rope_theta, rope_scaling=rope_scaling, qk_norm=True, sliding_window=None,
                layer_types=_layer_types(cfg, path), extra=_checked(fields, cfg, path))


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    value = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return float(PARTIAL_ROTARY_FACTOR if value is None else value)


def _layer_types(cfg: dict[str, Any], path: Path) -> tuple[str, ...]:
    """config.json's list, or Qwen3_5TextConfig's default pattern from full_attention_interval."""
    layers = int(cfg["num_hidden_layers"])
    every = int(cfg.get("full_attention_interval") or FULL_ATTENTION_INTERVAL)
    types = tuple(cfg.get("layer_types") or (LAYER_TYPES[(i + 1) % every == 0] for i in range(layers)))
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if len(types) != layers or unknown:
        raise ModelLoadError(f"{path}: layer_types must list {layers} of {', '.join(LAYER_TYPES)}, got {list(types)}")
    return types


def _checked(fields: Qwen35Fields, cfg: dict[str, Any], path: Path) -> Qwen35Fields:
    if fields.linear_num_value_heads % fields.linear_num_key_heads:
        raise ModelLoadError(f"{path}: linear_num_value_heads ({fields.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({fields.linear_num_key_heads})")
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    rotary_dim = fields.rotary_dim(head_dim)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise UnsupportedModelError(f"{path}: partial_rotary_factor {fields.partial_rotary_factor} gives {rotary_dim} of "
                                    f"{head_dim} channels (need an even count in (0, head_dim])")
    return fields


def qwen35_hf_config_fields(fields: Qwen35Fields, layer_types: tuple[str, ...], attention_bias: bool) -> dict[str, Any]:
    """What hf_config_dict adds for a qwen3_5_text model (read back by qwen35_hf_fields)."""
    return {**{key: getattr(fields, key) for key in LINEAR_FIELDS}, "partial_rotary_factor": fields.partial_rotary_factor,
            "layer_types": list(layer_types), "attention_bias": attention_bias}


def qwen35_gguf_fields(hp: Callable[..., Any], v_heads_tiled: bool = True) -> dict[str, Any]:
    """The ModelConfig fields Qwen3.5 sets itself, from GGUF `qwen35.*` metadata (llama.cpp's names: the SSM's state
    size is the key head dim, its group count the key heads, its time-step rank the value heads). block_count also
    counts the multi-token-prediction blocks the converter appends (`nextn_predict_layers`), which are not run.
    v_heads_tiled: whether the converter reordered the value heads (qwen35, qwen35moe; not qwen3next)."""
    layers = int(hp("block_count")) - int(hp("nextn_predict_layers", 0))
    key_dim, value_heads = int(hp("attention.key_length")), int(hp("ssm.time_step_rank"))
    fields = Qwen35Fields(int(hp("ssm.group_count")), value_heads, int(hp("ssm.state_size")),
                          int(hp("ssm.inner_size")) // value_heads, int(hp("ssm.conv_kernel")),
                          int(hp("rope.dimension_count")) / key_dim, v_heads_tiled=v_heads_tiled)
    recurrent = hp("attention.recurrent_layers", None)
    if recurrent is None:
        every = int(hp("full_attention_interval", FULL_ATTENTION_INTERVAL))
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    return dict(num_hidden_layers=layers, layer_types=tuple(LAYER_TYPES[not r] for r in recurrent[:layers]), qk_norm=True,
                extra=fields)
