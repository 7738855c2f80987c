"""Relevance scores (task "score") from a BERT cross-encoder, BertForSequenceClassification with one
label: [CLS] query [SEP] document [SEP] (token types 0 then 1) → BERT → pooler (dense + tanh on [CLS])
→ classifier → the activation sentence-transformers' CrossEncoder applies: the one its config names
(config_sentence_transformers.json's activation_fn, or config.json's older spellings), else sigmoid.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch

from llmpipe.errors import InvalidRequestError, UnsupportedModelError
from llmpipe.files import read_json
from llmpipe.models.bert.config import BertConfig
from llmpipe.models.bert.model import BertForSequenceClassification
from llmpipe.pooling.checkpoint import load_tensors, read_tensors
from llmpipe.pooling.inputs import Truncator, check_ids, load_tokenizer, max_input_length, right_padded
from llmpipe.pooling.pipeline import configured_max_length, transformer_dir
from llmpipe.tokenizer import Tokenizer

ARCHITECTURE = "BertForSequenceClassification"
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"Sigmoid": torch.sigmoid, "Identity": lambda x: x}


class BertCrossEncoder:
    task = "score"
    dimensions = 1
    normalize = False
    matryoshka = None

    def __init__(self, model: BertForSequenceClassification, cfg: BertConfig, tokenizer: Tokenizer, max_len: int,
                 activation: Callable[[torch.Tensor], torch.Tensor]):
        self.model, self.cfg, self.tokenizer, self.max_len = model.eval(), cfg, tokenizer, max_len
        self.vocab_size = cfg.vocab_size
        self.activation = activation
        self._truncator = Truncator(tokenizer, max_len)

    def encode_pair(self, query: str, document: str) -> tuple[list[int], list[int]]:
        """ids and token_type_ids of [CLS] query [SEP] document [SEP], cut to max_len longest text first."""
        return self._truncator.encode_pair(query, document)

    def score(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> torch.Tensor:
        """[B] float32 relevance, one forward for the whole batch."""
        if not batch:
            return torch.empty(0)
        for ids, type_ids in batch:
            check_ids(ids, self.cfg.vocab_size, self.max_len)
            if len(type_ids) != len(ids) or not all(0 <= t < self.cfg.type_vocab_size for t in type_ids):
                raise InvalidRequestError(f"token_type_ids must be one per token, each in [0, {self.cfg.type_vocab_size})")
        input_ids, valid = right_padded([ids for ids, _ in batch])
        token_type_ids, _ = right_padded([type_ids for _, type_ids in batch])
        with torch.inference_mode():
            return self.activation(self.model(input_ids, valid, token_type_ids)[:, 0])

    def encode(self, text: str) -> list[int]:
        raise InvalidRequestError("this model scores (query, document) pairs; it does not embed single texts")

    def embed(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        raise InvalidRequestError("this model scores (query, document) pairs; it does not embed single texts")


def is_sequence_classifier(cfg: dict[str, Any]) -> bool:
    return ARCHITECTURE in (cfg.get("architectures") or [])


def load_cross_encoder(path: Path) -> BertCrossEncoder:
    """A directory whose config.json is_sequence_classifier."""
    directory = transformer_dir(path)
    cfg_json = read_json(directory / "config.json")
    cfg = BertConfig.from_json(cfg_json, directory)
    if cfg.num_labels != 1:
        raise UnsupportedModelError(f"{directory}: a classifier with {cfg.num_labels} labels; llmpipe scores with "
                                    "one-label cross-encoders only")
    model = BertForSequenceClassification(cfg)
    load_tensors(model, read_tensors(directory), directory,
                 lambda name: None if name.endswith("embeddings.position_ids") else name)
    max_len = max_input_length(directory, configured_max_length(directory), cfg.max_position_embeddings)
    return BertCrossEncoder(model, cfg, load_tokenizer(directory), max_len, _activation(path, cfg_json))


def _activation(path: Path, cfg: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Where sentence-transformers 6 saves it, else where versions 4-5 and older ones did; sigmoid by default."""
    st_file = path / "config_sentence_transformers.json"
    name = (read_json(st_file).get("activation_fn") if st_file.is_file() else None) \
        or (cfg.get("sentence_transformers") or {}).get("activation_fn") \
        or cfg.get("sbert_ce_default_activation_function") or "Sigmoid"
    kind = name.rpartition(".")[2]
    if kind not in _ACTIVATIONS:
        raise UnsupportedModelError(f"{path}: cross-encoder activation {name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[kind]
