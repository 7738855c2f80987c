"""Sentence embeddings (task "embed") from a sentence-transformers directory: one forward of the
encoder body over the right-padded batch → pooling over each text's real tokens → the Dense
projections → L2 normalization where the model's pipeline ends with Normalize.

Bodies: BERT (model_type bert) and bidirectional Gemma 3 (EmbeddingGemma); weights from the
Transformer folder's model.safetensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmpipe.errors import InvalidRequestError, UnsupportedModelError
from llmpipe.files import read_json
from llmpipe.models.bert.config import BertConfig
from llmpipe.models.bert.model import BertModel
from llmpipe.loader.hf_config import hf_model_config
from llmpipe.models.gemma3.encoder import Gemma3Encoder, encoder_config
from llmpipe.pooling.checkpoint import load_tensors, read_tensors
from llmpipe.pooling.inputs import Truncator, check_ids, load_tokenizer, max_input_length, right_padded
from llmpipe.pooling.pipeline import SentencePipeline, read_pipeline
from llmpipe.tokenizer import Tokenizer


class SentenceEmbedder:
    task = "embed"

    def __init__(self, body: nn.Module, pipeline: SentencePipeline, tokenizer: Tokenizer, max_len: int,
                 vocab_size: int, hidden_size: int):
        self.model, self.pipeline, self.tokenizer = body.eval(), pipeline, tokenizer
        self.max_len, self.vocab_size = max_len, vocab_size
        self.dimensions = pipeline.dense[-1].weight.shape[0] if pipeline.dense else hidden_size
        self.normalize = pipeline.normalize
        self.matryoshka = pipeline.matryoshka
        self._truncator = Truncator(tokenizer, max_len)

    def encode(self, text: str) -> list[int]:
        """The text's ids, cut to max_len as sentence-transformers cuts it."""
        return self._truncator.encode(text)

    def embed(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B, dimensions] float32, one forward for the whole batch."""
        if not batch:
            return torch.empty(0, self.dimensions)
        for ids in batch:
            check_ids(ids, self.vocab_size, self.max_len)
        input_ids, valid = right_padded(batch)
        with torch.inference_mode():
            x = pool(self.model(input_ids, valid), valid, self.pipeline.pooling)
            for dense in self.pipeline.dense:
                x = dense(x)
            return F.normalize(x, dim=-1) if self.normalize else x

    def score(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> torch.Tensor:
        raise InvalidRequestError("this model embeds texts; it has no cross-encoder head to score pairs")

    def encode_pair(self, query: str, document: str) -> tuple[list[int], list[int]]:
        raise InvalidRequestError("this model embeds texts; it has no cross-encoder head to score pairs")


def pool(hidden: torch.Tensor, valid: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [B, T, H] → [B, H] over each row's real tokens (right padding: they come first)."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return hidden[torch.arange(hidden.shape[0]), valid.sum(1) - 1]
    mask = valid.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


def load_sentence_embedder(path: Path) -> SentenceEmbedder:
    pipeline = read_pipeline(path)
    directory = pipeline.transformer_dir
    cfg = read_json(directory / "config.json")
    body, vocab_size, hidden_size, max_positions = _body(cfg, directory)
    tokenizer = load_tokenizer(directory)
    max_len = max_input_length(directory, pipeline.max_seq_length, max_positions)
    return SentenceEmbedder(body, pipeline, tokenizer, max_len, vocab_size, hidden_size)


def _body(cfg: dict[str, Any], directory: Path) -> tuple[nn.Module, int, int, int]:
    """The encoder with its weights, its vocabulary size, hidden size and position limit."""
    tensors = read_tensors(directory)
    if cfg.get("model_type") == "bert":
        bert = BertConfig.from_json(cfg, directory)
        body = BertModel(bert)
        load_tensors(body, tensors, directory, _bert_embedding_name)
        return body, bert.vocab_size, bert.hidden_size, bert.max_position_embeddings
    if cfg.get("model_type") == "gemma3_text":
        gemma = encoder_config(cfg, hf_model_config(directory), directory)
        body = Gemma3Encoder(gemma)
        load_tensors(body, tensors, directory, lambda name: name.removeprefix("model."))
        return body, gemma.vocab_size, gemma.hidden_size, gemma.max_position_embeddings
    raise UnsupportedModelError(f"{directory}: model_type {cfg.get('model_type')!r} is not an encoder llmpipe serves "
                                "(bert, gemma3_text with use_bidirectional_attention)")


def _bert_embedding_name(name: str) -> str | None:
    """BertModel's name of a checkpoint tensor (`bert.` prefixes dropped), None for the pooler and the
    pre-training heads, which sentence embeddings do not read."""
    name = name.removeprefix("bert.")
    return None if name.startswith(("pooler.", "cls.")) or name == "embeddings.position_ids" else name
