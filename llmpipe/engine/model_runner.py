"""ModelRunner: makes the step's block copies, flattens a scheduled batch into tensors (token ids,
positions, and per KV cache group the metadata its kind builds from the block tables), runs one
forward pass, and returns the logits that need sampling and the hidden states that pooling requests
end with. Every layer receives its group's metadata. Where rows of the step name LoRA adapters, the
forward runs inside the LoRA manager's step, which adds each row's adapter delta (llmpipe/lora/).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager, NamedTuple, Protocol

import torch
from torch import nn

from llmpipe.config import EngineConfig
from llmpipe.kv_cache.kinds import BlockTable, GroupBatch
from llmpipe.engine.kv_pool import kv_cache_class
from llmpipe.kv_cache.layout import KVCacheLayout
from llmpipe.kv_cache.offload_tier import LoadBlock, OffloadTier, SaveBlock
from llmpipe.engine.block_manager import BlockTransfer
from llmpipe.engine.scheduler import SchedulerOutput
from llmpipe.quant.linear import decode_numerics
from llmpipe.lora.manager import LoRAManager

ChunkTables = tuple[list[BlockTable], int, int, int]  # a sequence's tables (one per group), start, end, first batch row


class StepInputs(NamedTuple):
    ids: torch.Tensor
    positions: torch.Tensor
    metas: list
    logit_rows: torch.Tensor  # rows whose logits the sampler reads (Runner.execute's order)
    pool_spans: list[tuple[int, int]]  # the rows of each pooling request's chunk, in chunk order


class RunnerOutput(NamedTuple):
    logits: torch.Tensor  # [logit rows, vocab]
    # [pooling chunks, 3, hidden]: each pooling request's chunk's final hidden states summed, its first row
    # and its last (what mean, cls and last-token pooling read); None: the runner pools nothing
    pooled: torch.Tensor | None


class KVCacheHandle(Protocol):
    """What the engine core uses of a runner's KV cache (paged, compressed, or sharded over ranks)."""

    bytes_per_token: int


class Runner(Protocol):
    """What the engine core computes a batch on: a ModelRunner, or a TensorParallelExecutor whose
    ranks each hold a shard of the model."""

    @property
    def kv_cache(self) -> KVCacheHandle: ...

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Logits [rows, vocab]: per decode one row and one per draft token, then one per prefill
        chunk that ends its prefill, then the chunks' prompt-logprob rows (see ModelRunner.execute);
        and the pooling requests' final hidden states."""

    def score(self, token_ids: list[int], block_tables: list[BlockTable], last_only: bool = False) -> torch.Tensor: ...

    def copy_blocks(self, copies: list[BlockTransfer]) -> None:
        """Block copies (source, destination) and offload-tier transfers, in order, before anything writes the
        cache again."""


class ModelRunner:
    def __init__(self, model: nn.Module, config: EngineConfig, num_blocks: int, layout: KVCacheLayout):
        self.model = model
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.layout = layout
        cfg = config.model_config
        self.kv_cache = kv_cache_class(cfg).build(cfg, layout, num_blocks, config, self.device)
        self.offload: OffloadTier | None = None  # the prefix cache's tier below the pool (set by the engine core)
        self.lora: LoRAManager | None = None  # the LoRA adapters' slots, with enable_lora (set by the executor)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Logits [rows, vocab]: per decode one row and one per draft token, then one per prefill
        chunk that ends its prefill, then the rows of the prefill chunks' prompt-logprob positions
        (`Sequence.prompt_logprob_positions`), in chunk order; and what the pooling requests' chunks
        computed (`RunnerOutput.pooled`)."""
        self.copy_blocks(batch.block_copies)
        inputs = self.prepare_inputs(batch)
        # Every row with the decode numerics, unless the step scores prompt positions (prompt logprobs:
        # the exact GEMM past KERNEL_MAX_BATCH rows, as engine.score).
        with decode_numerics(not any(item.seq.needs_prompt_logprobs for item in batch.prefills)), self.lora_step(batch):
            hidden = self.model(inputs.ids, inputs.positions, self.kv_cache.layers, inputs.metas)
            pooled = chunk_summaries(hidden, inputs.pool_spans)
            if not len(inputs.logit_rows):  # only chunks that end no sampled prompt (a long prompt's first chunks)
                return RunnerOutput(hidden.new_empty(0, self.config.model_config.vocab_size), pooled)
            return RunnerOutput(self.model.compute_logits(hidden[inputs.logit_rows]), pooled)

    def copy_blocks(self, copies: list[BlockTransfer]) -> None:
        """The block copies the scheduler queued (prefix hits inside a block, forked samples) and the offload
        tier's saves and loads, in order, before any write."""
        for op in copies:
            if isinstance(op, SaveBlock):
                self.offload.put(op.key, op.tokens, self.kv_cache.read_block(op.block_id))
            elif isinstance(op, LoadBlock):
                self.kv_cache.write_block(op.block_id, op.entry.tensors)
            else:
                self.kv_cache.copy_block(*op)

    def lora_step(self, batch: SchedulerOutput) -> ContextManager:
        """The forward's LoRA context: each row's adapter, in prepare_inputs' row order (decodes with their
        drafts, pooling rows, prefill chunks); nothing at all for a step without adapter rows."""
        if self.lora is None:
            return nullcontext()
        names = [seq.lora_name for seq in (*batch.decodes, *batch.pooling_rows)]
        names += [item.seq.lora_name for item in batch.prefills]
        if not any(names):
            return nullcontext()
        counts = [1 + len(batch.draft_token_ids.get(seq, ())) for seq in batch.decodes] + list(batch.pooling_rows.values())
        counts += [item.num_tokens for item in batch.prefills]
        return self.lora.step(names, counts)

    @torch.inference_mode()
    def score(self, token_ids: list[int], block_tables: list[BlockTable], last_only: bool = False,
              lora_name: str | None = None) -> torch.Tensor:
        """Logits [T, vocab] at every position (or [1, vocab] at the last) of a sequence computed
        from scratch into block_tables (under LoRA adapter `lora_name`, if given)."""
        metas = self.prefill_metadata(block_tables, len(token_ids))
        ids = torch.tensor(token_ids, device=self.device)
        with self.lora.step([lora_name], [len(token_ids)]) if lora_name is not None else nullcontext():
            hidden = self.model(ids, torch.arange(len(token_ids), device=self.device), self.kv_cache.layers, metas)
        return self.model.compute_logits(hidden[-1:] if last_only else hidden)

    def prefill_metadata(self, block_tables: list[BlockTable], num_tokens: int) -> list:
        """Per layer: one sequence's first num_tokens, computed from scratch into block_tables."""
        return self._layer_metadata([], [], [(block_tables, 0, num_tokens, 0)])

    def prepare_inputs(self, batch: SchedulerOutput) -> StepInputs:
        """A decode feeds its newest token and any draft tokens, each as a decode row of its own
        (the row at position p sees the keys up to p: drafts are verified in the batched decode
        path), and so does a pooling request's prompt beside them (`SchedulerOutput.pooling_rows`).
        Prefill chunks follow; their last rows give logits where they end a prefill, and a pooling
        request's chunk gives its rows to pool."""
        ids: list[int] = []
        positions: list[int] = []
        decode_tables: list[list[BlockTable]] = []
        lens: list[int] = []
        for seq in batch.decodes:
            fed = [seq.all_token_ids[-1], *batch.draft_token_ids.get(seq, ())]
            ids += fed
            positions.extend(range(seq.num_tokens - 1, seq.num_tokens - 1 + len(fed)))
            decode_tables += [seq.block_tables] * len(fed)
            lens.extend(range(seq.num_tokens, seq.num_tokens + len(fed)))
        logit_rows = list(range(len(ids)))
        pool_spans: list[tuple[int, int]] = []
        for seq, n in batch.pooling_rows.items():  # a pooling prompt's tokens as decode rows, as drafts are fed
            start = seq.num_computed_tokens
            pool_spans.append((len(ids), len(ids) + n))
            ids += seq.all_token_ids[start : start + n]
            positions.extend(range(start, start + n))
            decode_tables += [seq.block_tables] * n
            lens.extend(range(start + 1, start + n + 1))
        prompt_rows: list[int] = []
        chunks: list[ChunkTables] = []
        for item in batch.prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            chunks.append((seq.block_tables, start, end, len(ids)))
            prompt_rows += [len(ids) + q - start for q in seq.prompt_logprob_positions(start, end)]
            ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            if seq.pooling is not None:
                pool_spans.append((len(ids) - item.num_tokens, len(ids)))
            elif item.completes_prefill:
                logit_rows.append(len(ids) - 1)
        logit_rows += prompt_rows
        metas = self._layer_metadata(decode_tables, lens, chunks)
        rows = lambda r: torch.tensor(r, dtype=torch.long, device=self.device)  # noqa: E731
        return StepInputs(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), metas,
                          rows(logit_rows), pool_spans)

    def _layer_metadata(self, decode_tables: list[list[BlockTable]], lens: list[int], chunks: list[ChunkTables]):
        """Each group's metadata, built by its kind; every layer receives its group's."""
        groups = [
            group.spec.metadata(GroupBatch([tables[g] for tables in decode_tables], lens,
                                           [(tables[g], start, end, row) for tables, start, end, row in chunks]),
                                self.block_size, self.device)
            for g, group in enumerate(self.layout.groups)
        ]
        return self.layout.layer_metadata(groups)


def chunk_summaries(hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor | None:
    """[spans, 3, hidden]: each span's rows summed, its first row, its last row."""
    if not spans:
        return None
    return torch.stack([torch.stack([hidden[a:b].sum(0, dtype=torch.float32), hidden[a].float(), hidden[b - 1].float()])
                        for a, b in spans])
