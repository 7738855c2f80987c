"""The communicating layers of a tensor-parallel model, wrapped around a shard's ordinary ones.

A rank's model is the ordinary model built from its shard's config (fewer heads, FFN columns and
vocabulary rows), so q/k/v and gate/up are already column-parallel. `parallelize` then wraps
o_proj and down_proj (row-parallel: all-reduce the partial sums), the embedding (vocabulary-
parallel: each rank looks up its rows, zeros elsewhere, all-reduce) and the LM head (each rank's
vocabulary columns, gathered on rank 0, which samples).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmpipe.errors import UnsupportedModelError
from llmpipe.layers.linear import linear


class RowParallel(nn.Module):
    """A linear layer holding some input columns: the full output is the sum over ranks."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        if getattr(inner, "bias", None) is not None:
            raise UnsupportedModelError("a row-parallel layer with a bias would add it once per rank")
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x).contiguous()
        dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Looks up the ids in [start, start + rows) on this rank; the all-reduce fills in the rest."""

    def __init__(self, inner: nn.Module, vocab: range):
        super().__init__()
        self.inner, self.start, self.rows = inner, vocab.start, len(vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        elsewhere = (local < 0) | (local >= self.rows)
        x = self.inner(local.masked_fill(elsewhere, 0)).masked_fill(elsewhere[:, None], 0).contiguous()
        dist.all_reduce(x)
        return x


class TiedHead(nn.Module):
    """The LM head of a model whose (float) head is its embedding matrix."""

    def __init__(self, embedding: nn.Embedding, splits: int):
        super().__init__()
        self.embedding, self.splits = embedding, splits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.embedding.weight, splits=self.splits)


class ParallelLMHead(nn.Module):
    """Each rank's logits over its vocabulary rows, gathered into full rows on rank 0 (the other
    ranks get their own columns back, which nothing reads)."""

    def __init__(self, inner: nn.Module, vocab_sizes: list[int]):
        super().__init__()
        self.inner, self.sizes = inner, vocab_sizes

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 0:  # every rank sees the same metadata, so all skip the gather together
            return hidden.new_empty(0, sum(self.sizes))
        logits = self.inner(hidden)
        width = max(self.sizes)  # gather needs equal shapes: pad the smaller shards
        logits = F.pad(logits, (0, width - logits.shape[1])).contiguous()
        rank = dist.get_rank()
        parts = [torch.empty_like(logits) for _ in self.sizes] if rank == 0 else None
        dist.gather(logits, parts, dst=0)
        if rank != 0:
            return logits
        return torch.cat([part[:, :size] for part, size in zip(parts, self.sizes)], dim=1)


def parallelize(model: nn.Module, vocab: range, vocab_sizes: list[int]) -> nn.Module:
    """Wrap a shard's layers with their collectives (after its weights are loaded)."""
    body = model.model
    for layer in body.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj)
    head = model.lm_head if model.lm_head is not None else TiedHead(body.embed_tokens, model.splits)
    body.embed_tokens = VocabParallelEmbedding(body.embed_tokens, vocab)
    model.lm_head = ParallelLMHead(head, vocab_sizes)
    return model
