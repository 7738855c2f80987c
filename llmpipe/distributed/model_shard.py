"""One rank's model: built from its shard's config, filled with only its slices of the checkpoint
(each tensor is read, sliced and let go, so no rank ever holds the whole model), then wrapped with
its collectives. Every rank runs the same forward on its own paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmpipe.config import EngineConfig
from llmpipe.distributed.layers import parallelize
from llmpipe.distributed.sharding import plan_shards, shard_tensor
from llmpipe.engine.model_runner import RunnerOutput, chunk_summaries
from llmpipe.kv_cache.paged import PagedKVCache
from llmpipe.layers.attention import AttentionMetadata
from llmpipe.loader import Checkpoint
from llmpipe.models import build_model, resident_bytes


def load_shard(checkpoint: Checkpoint, config: EngineConfig, rank: int, world: int, progress: bool = False) -> nn.Module:
    """Rank `rank`'s model; config.model_config is the full model's (after engine options such as
    disable_sliding_window), config.device this rank's device."""
    plan = checkpoint.quant_plan(config.weight_quantization, config.group_size)
    shards = plan_shards(config.model_config, world, plan)
    shard = shards[rank]
    weights = (
        (name, shard_tensor(name, tensor, shard, plan.get(name)))
        for name, tensor in checkpoint.iter_weights(progress=progress, plan=plan)
    )
    model = build_model(shard.model_config(config.model_config), weights, config.torch_dtype, config.device, plan,
                        config.activation_quantization, config.float_batch_weights)
    return parallelize(model, shard.vocab, [len(s.vocab) for s in shards])


@torch.inference_mode()
def forward(
    model: nn.Module, kv_cache: PagedKVCache, ids: torch.Tensor, positions: torch.Tensor,
    metas: list[AttentionMetadata], logit_rows: torch.Tensor, pool_spans: list[tuple[int, int]] = (),
) -> RunnerOutput:
    """ModelRunner's forward on one rank: full logits on rank 0, this rank's columns elsewhere; the pooling
    chunks' summaries (the hidden states are whole on every rank after the all-reduce)."""
    hidden = model(ids, positions, kv_cache.layers, metas)
    return RunnerOutput(model.compute_logits(hidden[logit_rows]), chunk_summaries(hidden, list(pool_spans)))


@dataclass
class RankMemory:
    rank: int
    weight_bytes: int  # parameters and buffers resident on this rank
    kv_cache_bytes: int  # this rank's paged KV cache
    num_blocks: int


def rank_memory(rank: int, model: nn.Module, kv_cache: PagedKVCache, num_blocks: int) -> RankMemory:
    kv_bytes = sum(t.numel() * t.element_size() for t in kv_cache.tensors)
    return RankMemory(rank, resident_bytes(model), kv_bytes, num_blocks)
