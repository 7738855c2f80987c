"""ModelConfig from a Hugging Face directory's config.json (+ generation_config.json): the fields every
architecture has here, the family's own from its ModelFamily (llmpipe/models/family.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.config import ModelConfig
from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.files import read_json
from llmpipe.layers.activation import check_activation
from llmpipe.loader.hf_rope import hf_rope
from llmpipe.models import registry  # a module, not its names: the families import loader modules in turn


def hf_model_config(directory: Path) -> ModelConfig:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory}: no config.json (not a Hugging Face model directory)")
    cfg = read_json(config_path)
    family = registry.hf_family(cfg.get("model_type"), config_path)
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{config_path}: mlp_bias=true is not supported")
    generation_path = directory / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else {}
    cfg, own = family.hf_fields(cfg, config_path)

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ModelLoadError(f"{config_path}: missing {key!r}")
        return cfg[key]

    heads = int(need("num_attention_heads"))
    rope_theta, rope_scaling = hf_rope(cfg)
    window = cfg.get("sliding_window")
    common = dict(
        architecture=cfg["model_type"],
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
        attention_bias=bool(cfg.get("attention_bias", False)),
        sliding_window=int(window) if window else None,
        # Gemma's configs carry both; transformers' Gemma reads hidden_activation
        hidden_act=check_activation(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu", config_path),
        bos_token_id=_first(cfg.get("bos_token_id"), generation.get("bos_token_id")),
        eos_token_ids=_token_ids(cfg.get("eos_token_id"), generation.get("eos_token_id")),
    )
    return ModelConfig(**(common | own))


def _first(*values: Any) -> int | None:
    return next((int(v) for v in values if v is not None), None)


def _token_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    """Merge token ids given as int, list or None, in order, without duplicates."""
    ids: list[int] = []
    for value in values:
        ids.extend([] if value is None else [value] if isinstance(value, int) else value)
    return tuple(dict.fromkeys(int(i) for i in ids))


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """The config.json that hf_model_config reads back as `config` (what `llmpipe quantize` writes)."""
    family = registry.family_of(config.architecture)
    if config.architecture not in family.hf_architectures:
        raise UnsupportedModelError(f"llmpipe does not write config.json for {config.architecture!r} models")
    eos = list(config.eos_token_ids)
    return {
        "architectures": [family.hf_architectures[config.architecture]],
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
        "hidden_act": config.hidden_act,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        **family.hf_config_fields(config),
    }
