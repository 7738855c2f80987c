"""Gemma 3's own config fields, and its published defaults for checkpoints that leave them out.

llama.cpp's GGUF conversion drops the local (sliding-window) RoPE base, the local/global layer
pattern and `query_pre_attn_scalar`; old config.json files may lack some too. transformers fills
them from `Gemma3TextConfig`'s defaults, and so does llmpipe, with the same values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.hf_rope import hf_rope

GEMMA3_DEFAULTS = {
    "rope_theta": 1_000_000.0,  # global (full-attention) layers
    "rope_local_theta": 10_000.0,  # sliding-window layers
    "sliding_window_pattern": 6,  # every 6th layer is global
    "query_pre_attn_scalar": 256.0,
}


def gemma3_layer_types(num_layers: int, pattern: int | None = None) -> tuple[str, ...]:
    """Layer i is global when (i + 1) is a multiple of the pattern, as in Gemma3TextConfig."""
    every = pattern or GEMMA3_DEFAULTS["sliding_window_pattern"]
    return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers))


def gemma3_hf_fields(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """Gemma 3's own ModelConfig fields from config.json. RoPE comes per layer type (transformers 5:
    `rope_parameters` keyed by "full_attention" / "sliding_attention"; older files: rope_theta,
    rope_local_base_freq, rope_scaling)."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(f"{path}: attention logit soft-capping is not supported")
    params = cfg.get("rope_parameters") or {}
    full, local = params.get("full_attention"), params.get("sliding_attention")
    if full is not None:
        rope_theta, rope_scaling = hf_rope({"rope_parameters": full, "rope_theta": GEMMA3_DEFAULTS["rope_theta"]})
        local_theta = float((local or {}).get("rope_theta") or GEMMA3_DEFAULTS["rope_local_theta"])
    else:
        rope_theta, rope_scaling = hf_rope({**cfg, "rope_theta": cfg.get("rope_theta") or GEMMA3_DEFAULTS["rope_theta"]})
        local_theta = float(cfg.get("rope_local_base_freq") or GEMMA3_DEFAULTS["rope_local_theta"])
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or gemma3_layer_types(layers, cfg.get("sliding_window_pattern"))
    return dict(
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm=True,
        layer_types=tuple(layer_types),
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or GEMMA3_DEFAULTS["query_pre_attn_scalar"]),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


def gemma3_gguf_fields(hp: Callable[..., Any]) -> dict[str, Any]:
    """llama.cpp's Gemma 3 GGUF lacks the layer pattern, the local RoPE base and query_pre_attn_scalar:
    Gemma 3's published defaults fill them, as transformers does when it loads such a file."""
    return dict(
        hidden_act="gelu_pytorch_tanh",
        layer_types=gemma3_layer_types(int(hp("block_count"))),
        rope_local_theta=GEMMA3_DEFAULTS["rope_local_theta"],
        query_pre_attn_scalar=GEMMA3_DEFAULTS["query_pre_attn_scalar"],
        final_logit_softcapping=hp("final_logit_softcapping", None),
    )
