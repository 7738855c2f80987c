"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron-style).

Column-parallel (output rows split): q/k/v by attention head, gate/up by FFN column, the embedding
and LM head by vocabulary row. Row-parallel (input columns split, outputs summed by an all-reduce):
o_proj by head, down_proj by FFN column. Norms are replicated.

Ranks take whole KV groups: rank r holds some KV heads and the query heads that read them, so
attention needs no communication. With fewer KV heads than ranks each KV head is replicated on
world / kv_heads ranks (as vLLM does). Uneven splits are allowed (SmolLM2's 3 KV heads on 2 ranks:
2 + 1); lower ranks take the larger share.

Quantized weights are sliced as stored: rows with their scales; input columns only at group
boundaries, so each rank's groups are the single-process model's groups. A float weight bound for
a quantized row-parallel layer is quantized whole first (int8's per-row scale depends on the whole
row), then sliced: every rank computes exactly the single-process quantized model's function.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmpipe.config import ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.quant.apply import QuantPlan, WeightFormat
from llmpipe.quant.formats import Q5_0_BLOCK, GGMLWeight, Int4Weight, Int8Weight, Q5_0Weight, QuantizedWeight
from llmpipe.quant.rtn import quantize_int4, quantize_int8

Weight = torch.Tensor | QuantizedWeight

COLUMN_PARALLEL = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "ffn", "up_proj": "ffn"}
ROW_PARALLEL = {"o_proj": "q", "down_proj": "ffn"}
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Shard:
    """One rank's piece of the model, as index ranges into the full model's dimensions."""

    rank: int
    q_heads: range
    kv_heads: range
    ffn: range  # intermediate (FFN) columns
    vocab: range
    head_dim: int

    def span(self, kind: str) -> range:
        """Rows (column-parallel) or input columns (row-parallel) of a weight of this kind."""
        if kind == "ffn":
            return self.ffn
        heads = self.q_heads if kind == "q" else self.kv_heads
        return range(heads.start * self.head_dim, heads.stop * self.head_dim)

    def model_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's model: its heads, FFN columns and vocabulary rows."""
        return dataclasses.replace(
            cfg, num_attention_heads=len(self.q_heads), num_key_value_heads=len(self.kv_heads),
            intermediate_size=len(self.ffn), vocab_size=len(self.vocab),
        )


def split(total: int, parts: int, unit: int = 1) -> list[range]:
    """[0, total) in `parts` contiguous ranges whose boundaries are multiples of `unit` (the last
    may end mid-unit), as even as possible, larger ones first."""
    units = -(-total // unit)
    if units < parts:
        raise UnsupportedModelError(f"cannot split {total} into {parts} parts of whole {unit}s")
    bounds = [0]
    for i in range(parts):
        bounds.append(min(total, bounds[-1] + (units // parts + (i < units % parts)) * unit))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def plan_shards(cfg: ModelConfig, world: int, plan: QuantPlan | None = None) -> list[Shard]:
    """Every rank's shard. Raises UnsupportedModelError, naming the constraint, where the model
    cannot be split this way."""
    heads = _head_split(cfg, world)
    _check_groups(heads, cfg.head_dim, _group(plan, "self_attn.o_proj"), "o_proj (attention heads)")
    ffn = split(cfg.intermediate_size, world, _group(plan, "mlp.down_proj") or 1)
    vocab = split(cfg.vocab_size, world)
    return [Shard(r, q, kv, ffn[r], vocab[r], cfg.head_dim) for r, (q, kv) in enumerate(heads)]


def _head_split(cfg: ModelConfig, world: int) -> list[tuple[range, range]]:
    """(query heads, KV heads) per rank."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if kv >= world:
        per_group = heads // kv
        return [(range(g.start * per_group, g.stop * per_group), g) for g in split(kv, world)]
    if world % kv or heads % world:
        raise UnsupportedModelError(
            f"tensor_parallel_size={world}: {kv} KV heads can be replicated only when it divides the world size, "
            f"and the {heads} query heads must split evenly (try a size dividing {heads} and a multiple of {kv})"
        )
    per_rank = heads // world
    return [(range(r * per_rank, (r + 1) * per_rank), range(r * kv // world, r * kv // world + 1)) for r in range(world)]


def _group(plan: QuantPlan | None, suffix: str) -> int | None:
    """The input-group size of a (row-parallel) weight's quantized format, if grouped."""
    formats = {fmt for name, fmt in (plan or {}).items() if name.endswith(f"{suffix}.weight") and fmt is not None}
    groups = {group for kind, group in formats if group is not None}
    return max(groups) if groups else None


def _check_groups(heads: list[tuple[range, range]], head_dim: int, group: int | None, what: str) -> None:
    if group is None:
        return
    for rank, (q, _) in enumerate(heads):
        if q.start * head_dim % group:
            raise UnsupportedModelError(
                f"tensor parallelism splits {what} inputs at column {q.start * head_dim} (rank {rank}), inside a "
                f"quantization group of {group}: use a group size dividing {q.start * head_dim}, or another tensor_parallel_size"
            )


def shard_tensor(name: str, tensor: Weight, shard: Shard, fmt: WeightFormat | None) -> Weight:
    """This rank's slice of checkpoint tensor `name` (a copy where it is a slice, so the full tensor can go)."""
    if name in VOCAB_PARALLEL:
        return slice_rows(tensor, shard.vocab)
    kind = name.split(".")[-2]
    if kind in COLUMN_PARALLEL:
        return slice_rows(tensor, shard.span(COLUMN_PARALLEL[kind]))
    if kind in ROW_PARALLEL:
        if fmt is not None and isinstance(tensor, torch.Tensor):
            tensor = quantize_int8(tensor) if fmt[0] == "int8" else quantize_int4(tensor, fmt[1])
        return slice_columns(tensor, shard.span(ROW_PARALLEL[kind]), name)
    return tensor


def slice_rows(w: Weight, rows: range) -> Weight:
    """Output rows (weights, biases) with their per-row scales."""
    take = lambda t: t[rows.start : rows.stop].clone()  # noqa: E731
    if isinstance(w, torch.Tensor):
        return take(w)
    if isinstance(w, Int8Weight):
        return Int8Weight(take(w.q), take(w.scale), w.group_size)
    if isinstance(w, Q5_0Weight):
        return Q5_0Weight(take(w.blocks))
    if isinstance(w, GGMLWeight):
        return GGMLWeight(w.ggml_type, take(w.blocks))
    return Int4Weight(take(w.q), take(w.scale), take(w.offset), w.group_size, w.in_perm)


def slice_columns(w: Weight, cols: range, name: str) -> Weight:
    """Input columns, with the groups of scales they span (`cols` must start at a group boundary)."""
    if isinstance(w, torch.Tensor):
        return w[:, cols.start : cols.stop].clone()
    if isinstance(w, Q5_0Weight):
        if cols.start % Q5_0_BLOCK or cols.stop % Q5_0_BLOCK:
            raise UnsupportedModelError(f"{name}: input columns {cols.start}-{cols.stop} split a Q5_0 block of {Q5_0_BLOCK}")
        first, last = (Q5_0Weight.bytes_per_row(c) for c in (cols.start, cols.stop))
        return Q5_0Weight(w.blocks[:, first:last].clone())
    if isinstance(w, GGMLWeight):
        weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(w.ggml_type)]
        if cols.start % weights or cols.stop % weights:
            raise UnsupportedModelError(f"{name}: input columns {cols.start}-{cols.stop} split a block of {weights}")
        return GGMLWeight(w.ggml_type, w.blocks[:, cols.start // weights * nbytes : cols.stop // weights * nbytes].clone())
    group = w.group_size
    if isinstance(w, Int4Weight) and w.in_perm is not None:
        raise UnsupportedModelError(f"{name}: act-order (g_idx) int4 weights cannot be split by input columns")
    q = w.q[:, cols.start : cols.stop].clone()
    if group is None:  # int8 per output row: every rank keeps the whole row's scale
        return Int8Weight(q, w.scale, None)
    if cols.start % group:
        raise UnsupportedModelError(f"{name}: input columns from {cols.start} do not start a group of {group}")
    groups = slice(cols.start // group, -(-cols.stop // group))
    if isinstance(w, Int8Weight):
        return Int8Weight(q, w.scale[:, groups].clone(), group)
    return Int4Weight(q, w.scale[:, groups].clone(), w.offset[:, groups].clone(), group)
