"""ModelConfig from a Hugging Face directory's config.json (+ generation_config.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.config import LLAMA_FAMILY, ModelConfig
from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.files import read_json


def hf_model_config(directory: Path) -> ModelConfig:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory}: no config.json (not a Hugging Face model directory)")
    cfg = read_json(config_path)
    _check_supported(cfg, config_path)
    generation_path = directory / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else {}

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ModelLoadError(f"{config_path}: missing {key!r}")
        return cfg[key]

    model_type = cfg["model_type"]
    heads = int(need("num_attention_heads"))
    rope_theta, rope_scaling = _rope(cfg)
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size")),
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or need("hidden_size") // heads),
        max_position_embeddings=int(need("max_position_embeddings")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=_sliding_window(cfg),
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=_first(cfg.get("bos_token_id"), generation.get("bos_token_id")),
        eos_token_ids=_token_ids(cfg.get("eos_token_id"), generation.get("eos_token_id")),
    )


def _check_supported(cfg: dict[str, Any], path: Path) -> None:
    model_type = cfg.get("model_type")
    if model_type not in LLAMA_FAMILY:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(LLAMA_FAMILY)})"
        )
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "unknown")
        raise UnsupportedModelError(f"{path}: pre-quantized checkpoints ({method}) are not supported")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{path}: mlp_bias=true is not supported")


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either spelling: transformers 5 writes `rope_parameters`
    ({"rope_theta", "rope_type", …}); older files have top-level rope_theta and `rope_scaling`
    (whose type key may be the legacy "type")."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **params}


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """Mistral uses its window whenever set; Qwen2/Qwen3 only with use_sliding_window."""
    if cfg["model_type"] in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def _first(*values: Any) -> int | None:
    return next((int(v) for v in values if v is not None), None)


def _token_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    """Merge token ids given as int, list or None, in order, without duplicates."""
    ids: list[int] = []
    for value in values:
        ids.extend([] if value is None else [value] if isinstance(value, int) else value)
    return tuple(dict.fromkeys(int(i) for i in ids))
