"""BERT (Devlin et al., 2018) as an encoder over a right-padded batch, without a KV cache.

word + position + token_type embeddings → LayerNorm → N × [self-attention (biased q/k/v, every
token sees every real token) → dense → add & LayerNorm → GELU FFN → add & LayerNorm].
BertForSequenceClassification adds the pooler (dense + tanh on [CLS]) and a linear classifier.
Module and parameter names are Hugging Face's, so a checkpoint's state dict loads as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmpipe.layers.activation import ACTIVATIONS
from llmpipe.models.bert.config import BertConfig


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H], key_mask [B, 1, 1, T] (True: a real token) → [B, T, H]."""
        def split_heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, H] → [B, heads, T, head_dim]
            return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

        q, k, v = split_heads(self.query(x)), split_heads(self.key(x)), split_heads(self.value(x))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask).transpose(1, 2).flatten(2)


class BertAddNorm(nn.Module):
    """dense(x) + residual → LayerNorm: the end of both sublayers (BertSelfOutput and BertOutput)."""

    def __init__(self, in_features: int, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)  # Hugging Face's name: attention.self.query ...
        self.output = BertAddNorm(cfg.hidden_size, cfg)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, key_mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.activation = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertAddNorm(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, key_mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, key_mask)
        return x


class BertModel(nn.Module):
    """Token ids [B, T] → hidden states [B, T, H]; padded positions hold values no one should read.
    The pooler exists only where a head reads it (sentence embeddings pool the hidden states instead)."""

    def __init__(self, cfg: BertConfig, with_pooler: bool = False):
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg) if with_pooler else None

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """valid [B, T]: True on real tokens; token_type_ids default to segment 0."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        key_mask = valid[:, None, None, :]
        return self.encoder(self.embeddings(input_ids, token_type_ids), key_mask)


class BertPooler(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertForSequenceClassification(nn.Module):
    """A cross-encoder: [CLS] q [SEP] d [SEP] → pooler → classifier logits [B, num_labels]."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.bert = BertModel(cfg, with_pooler=True)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.bert.pooler(self.bert(input_ids, valid, token_type_ids)))
