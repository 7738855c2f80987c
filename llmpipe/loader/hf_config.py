"""ModelConfig from a Hugging Face directory's config.json (+ generation_config.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.config import DEEPSEEK_V4_FAMILY, LLAMA_FAMILY, ModelConfig
from llmpipe.models.deepseek_v4.config import deepseek_v4_config
from llmpipe.models.gemma3.config import GEMMA3_DEFAULTS, gemma3_layer_types

SUPPORTED_MODEL_TYPES = (*LLAMA_FAMILY, "gemma3_text", *DEEPSEEK_V4_FAMILY)
from llmpipe.layers.activation import check_activation
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
    extra: dict[str, Any] = {}
    if model_type in DEEPSEEK_V4_FAMILY:  # its own names and defaults, rewritten to the ones read below
        cfg, extra["deepseek_v4"] = deepseek_v4_config(cfg, config_path)
    heads = int(need("num_attention_heads"))
    rope_theta, rope_scaling = _rope(cfg)
    gemma3 = _gemma3_fields(cfg, config_path) if model_type == "gemma3_text" else {}
    if gemma3:
        rope_theta, rope_scaling = gemma3.pop("rope")
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
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "gemma3_text")),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        sliding_window=_sliding_window(cfg),
        # Gemma's configs carry both; transformers' Gemma reads hidden_activation
        hidden_act=check_activation(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu", config_path),
        bos_token_id=_first(cfg.get("bos_token_id"), generation.get("bos_token_id")),
        eos_token_ids=_token_ids(cfg.get("eos_token_id"), generation.get("eos_token_id")),
        **gemma3,
        **extra,
    )


def _check_supported(cfg: dict[str, Any], path: Path) -> None:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
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


def _gemma3_fields(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """Gemma 3's extra fields. RoPE comes per layer type (transformers 5: `rope_parameters` keyed by
    "full_attention" / "sliding_attention"; older files: rope_theta, rope_local_base_freq, rope_scaling)."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(f"{path}: attention logit soft-capping is not supported")
    params = cfg.get("rope_parameters") or {}
    full, local = params.get("full_attention"), params.get("sliding_attention")
    if full is not None:
        rope = _rope({"rope_parameters": full, "rope_theta": GEMMA3_DEFAULTS["rope_theta"]})
        local_theta = float((local or {}).get("rope_theta") or GEMMA3_DEFAULTS["rope_local_theta"])
    else:
        rope = _rope({**cfg, "rope_theta": cfg.get("rope_theta") or GEMMA3_DEFAULTS["rope_theta"]})
        local_theta = float(cfg.get("rope_local_base_freq") or GEMMA3_DEFAULTS["rope_local_theta"])
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or gemma3_layer_types(layers, cfg.get("sliding_window_pattern"))
    return dict(
        rope=rope,
        layer_types=tuple(layer_types),
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or GEMMA3_DEFAULTS["query_pre_attn_scalar"]),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


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


HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """The config.json that hf_model_config reads back as `config` (what `llmpipe quantize` writes)."""
    eos = list(config.eos_token_ids)
    return {
        "architectures": [HF_ARCHITECTURES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "sliding_window": config.sliding_window,
        "use_sliding_window": config.sliding_window is not None,
        "hidden_act": config.hidden_act,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
