"""The interface of llmpipe's encoder models, and finding and loading one.

Embedding and rerank models attend bidirectionally and need no KV cache: each call runs one forward
over a right-padded batch (float32, inference mode). `load_encoder` reads a directory: a
sentence-transformers embedding model (modules.json: Transformer → Pooling → Dense* → Normalize, on
BERT or bidirectional Gemma 3) or a BERT cross-encoder (BertForSequenceClassification, one label).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from llmpipe.errors import ModelLoadError
from llmpipe.files import read_json
from llmpipe.pooling.cross_encoder import is_sequence_classifier, load_cross_encoder
from llmpipe.pooling.embedder import load_sentence_embedder
from llmpipe.pooling.pipeline import transformer_dir
from llmpipe.tokenizer import Tokenizer


class Encoder(Protocol):
    task: str  # "embed" (sentence embeddings) or "score" (a cross-encoder: a relevance score per pair)
    max_len: int  # tokens per input: sentence-transformers' max_seq_length, within the model's positions
    dimensions: int  # embedding width; 1 for "score"
    normalize: bool  # whether the model's own pipeline L2-normalizes (sentence-transformers' Normalize)
    matryoshka: tuple[int, ...] | None  # the dimensions it was trained to be cut to, where its card declares them
    tokenizer: Tokenizer
    model: nn.Module  # the encoder's weights
    vocab_size: int  # the ids its embedding takes

    def encode(self, text: str) -> list[int]:
        """ids for embed(), cut to max_len as sentence-transformers cuts them ("embed")."""

    def embed(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B, dimensions] float32: pooled, projected, normalized where the model does ("embed").
        Inputs are unpadded id lists of up to max_len tokens; others raise InvalidRequestError."""

    def encode_pair(self, query: str, document: str) -> tuple[list[int], list[int]]:
        """ids and token_type_ids of the pair, cut to max_len ("score")."""

    def score(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> torch.Tensor:
        """[B] float32 relevance of encode_pair outputs ("score")."""


def is_encoder(path: Path) -> bool:
    """Whether a directory holds a model for load_encoder rather than the LLM engine; reads config.json only
    (beside modules.json, or in the folder it names for the Transformer)."""
    path = Path(path)
    try:
        cfg = read_json(transformer_dir(path) / "config.json") if path.is_dir() else {}
    except ModelLoadError:  # no or unreadable config.json / modules.json: not ours to claim
        return False
    model_type = cfg.get("model_type")
    return model_type == "bert" or (model_type == "gemma3_text" and bool(cfg.get("use_bidirectional_attention")))


def load_encoder(path: Path) -> Encoder:
    """Raises UnsupportedModelError for a directory llmpipe cannot serve as an encoder, ModelLoadError for a broken one."""
    path = Path(path)
    config = transformer_dir(path) / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"{path}: no config.json")
    if is_sequence_classifier(read_json(config)):
        return load_cross_encoder(path)
    return load_sentence_embedder(path)
