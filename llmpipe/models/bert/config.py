"""BERT's config.json fields, checked for what llmpipe's encoder computes.

Absolute positions only (no relative-key variants), an encoder only (no cross-attention),
and a hidden_act from llmpipe.layers.activation; anything else is refused rather than computed wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.errors import UnsupportedModelError
from llmpipe.layers.activation import check_activation


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    num_labels: int  # classifier outputs of a BertForSequenceClassification checkpoint

    @classmethod
    def from_json(cls, cfg: dict[str, Any], path: Path) -> BertConfig:
        if cfg.get("model_type") != "bert":
            raise UnsupportedModelError(f"{path}: model_type {cfg.get('model_type')!r} is not BERT")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(f"{path}: position_embedding_type {cfg['position_embedding_type']!r} "
                                        "is not supported (absolute only)")
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise UnsupportedModelError(f"{path}: a BERT decoder (is_decoder / add_cross_attention) is not an encoder")
        if cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise UnsupportedModelError(f"{path}: hidden_size is not a multiple of num_attention_heads")
        labels = cfg.get("id2label")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            hidden_act=check_activation(cfg.get("hidden_act", "gelu"), path),
            num_labels=len(labels) if labels else int(cfg.get("num_labels", 2)),  # transformers saves id2label
        )
