"""Gemma 3's published defaults, for checkpoints that leave them out.

llama.cpp's GGUF conversion drops the local (sliding-window) RoPE base, the local/global layer
pattern and `query_pre_attn_scalar`; old config.json files may lack some too. transformers fills
them from `Gemma3TextConfig`'s defaults, and so does llmpipe, with the same values.
"""

from __future__ import annotations

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
