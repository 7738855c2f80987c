"""ModelRunner: flattens a scheduled batch into tensors (token ids, positions, slot mapping, block
tables → AttentionMetadata), runs one forward pass, and returns the logits that need sampling.

Each KV cache group gets its own metadata: its block tables, cut down to the blocks its window
still reads (context lengths counted from the first of them, which leaves window masks unchanged:
they depend only on distances); every layer receives its group's.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from llmpipe.config import EngineConfig
from llmpipe.engine.block_manager import BlockTable
from llmpipe.engine.kv_cache import make_kv_cache
from llmpipe.engine.kv_cache_spec import KVCacheLayout, KVCacheSpec
from llmpipe.engine.scheduler import SchedulerOutput
from llmpipe.layers.attention import AttentionMetadata, PrefillChunk

ChunkRows = tuple[list[BlockTable], int, int, int]  # a sequence's tables, start, end, first row in the batch


class KVCacheHandle(Protocol):
    """What the engine core uses of a runner's KV cache (paged, compressed, or sharded over ranks)."""

    bytes_per_token: int

    def copy_block(self, src: int, dst: int) -> None: ...


class Runner(Protocol):
    """What the engine core computes a batch on: a ModelRunner, or a TensorParallelExecutor whose
    ranks each hold a shard of the model."""

    @property
    def kv_cache(self) -> KVCacheHandle: ...

    def execute(self, batch: SchedulerOutput) -> torch.Tensor:
        """Logits [rows, vocab]: per decode one row and one per draft token, then one per prefill
        chunk that ends its prefill, then the chunks' prompt-logprob rows (see ModelRunner.execute)."""

    def score(self, token_ids: list[int], block_tables: list[BlockTable], last_only: bool = False) -> torch.Tensor: ...


class ModelRunner:
    def __init__(self, model: nn.Module, config: EngineConfig, num_blocks: int, layout: KVCacheLayout):
        self.model = model
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.layout = layout
        self.kv_cache = make_kv_cache(
            config.model_config, num_blocks, config.block_size, config.torch_dtype, self.device, layout,
            config.kv_cache_dtype,
        )

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> torch.Tensor:
        """Logits [rows, vocab]: per decode one row and one per draft token, then one per prefill
        chunk that ends its prefill, then the rows of the prefill chunks' prompt-logprob positions
        (`Sequence.prompt_logprob_positions`), in chunk order."""
        ids, positions, metas, logit_rows = self.prepare_inputs(batch)
        hidden = self.model(ids, positions, self.kv_cache.layers, metas)
        return self.model.compute_logits(hidden[logit_rows])

    @torch.inference_mode()
    def score(self, token_ids: list[int], block_tables: list[BlockTable], last_only: bool = False) -> torch.Tensor:
        """Logits [T, vocab] at every position (or [1, vocab] at the last) of a sequence computed
        from scratch into block_tables."""
        metas = self.prefill_metadata(block_tables, len(token_ids))
        ids = torch.tensor(token_ids, device=self.device)
        hidden = self.model(ids, torch.arange(len(token_ids), device=self.device), self.kv_cache.layers, metas)
        return self.model.compute_logits(hidden[-1:] if last_only else hidden)

    def prefill_metadata(self, block_tables: list[BlockTable], num_tokens: int) -> list[AttentionMetadata]:
        """Per layer: one sequence's first num_tokens, computed from scratch into block_tables."""
        return self._layer_metadata([], [], [(block_tables, 0, num_tokens, 0)])

    def prepare_inputs(self, batch: SchedulerOutput):
        """A decode feeds its newest token and any draft tokens, each as a decode row of its own
        (the row at position p sees the keys up to p: drafts are verified in the batched decode
        path). Prefill chunks follow; their last rows give logits where they end a prefill."""
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
        prompt_rows: list[int] = []
        chunks: list[ChunkRows] = []
        for item in batch.prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            chunks.append((seq.block_tables, start, end, len(ids)))
            prompt_rows += [len(ids) + q - start for q in seq.prompt_logprob_positions(start, end)]
            ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            if item.completes_prefill:
                logit_rows.append(len(ids) - 1)
        logit_rows += prompt_rows
        metas = self._layer_metadata(decode_tables, lens, chunks)
        ids_t = torch.tensor(ids, device=self.device)
        return ids_t, torch.tensor(positions, device=self.device), metas, torch.tensor(logit_rows, dtype=torch.long, device=self.device)

    def _layer_metadata(self, decode_tables: list[list[BlockTable]], lens: list[int], chunks: list[ChunkRows]):
        groups = [
            self._group_metadata(group.spec, [tables[g] for tables in decode_tables], lens,
                                 [(tables[g], start, end, row) for tables, start, end, row in chunks])
            for g, group in enumerate(self.layout.groups)
        ]
        return self.layout.layer_metadata(groups)

    def _group_metadata(
        self, spec: KVCacheSpec, tables: list[BlockTable], lens: list[int], chunks: list[tuple[BlockTable, int, int, int]]
    ) -> AttentionMetadata:
        if spec.ratio > 1:
            return self._entry_metadata(tables, lens, chunks)
        size, device = self.block_size, self.device
        slots = [torch.tensor([t.block_of(n - 1, size) * size + (n - 1) % size for t, n in zip(tables, lens)], dtype=torch.long, device=device)]
        decode_tables = decode_lens = None
        firsts = [spec.first_needed_block(n - 1, size) for n in lens]
        local_lens = [n - first * size for n, first in zip(lens, firsts)]
        if tables:
            rows = [t.ids[first - t.offset :] for t, first in zip(tables, firsts)]
            width = max(map(len, rows))
            decode_tables = torch.tensor([row + [0] * (width - len(row)) for row in rows], device=device)
            decode_lens = torch.tensor(local_lens, device=device)
        prefills = []
        for table, start, end, row in chunks:
            first = spec.first_needed_block(start, size)
            blocks = torch.tensor(table.ids[first - table.offset : -(-end // size) - table.offset], device=device)
            local = torch.arange(start - first * size, end - first * size, device=device)
            slots.append(blocks[local // size] * size + local % size)
            prefills.append(PrefillChunk(row, row + end - start, end - first * size, blocks, start))
        return AttentionMetadata(
            torch.cat(slots), len(lens), decode_tables, decode_lens, prefills,
            decode_max_len=max(local_lens, default=0), decode_same_len=len(set(local_lens)) <= 1,
            decode_positions=[n - 1 for n in lens], decode_lens=local_lens,
        )

    def _entry_metadata(
        self, tables: list[BlockTable], lens: list[int], chunks: list[tuple[BlockTable, int, int, int]]
    ) -> AttentionMetadata:
        """A compressed group's whole tables (its layers write the entries they pool themselves)."""
        device = self.device
        decode_tables = None
        if tables:
            width = max(len(t.ids) for t in tables)
            decode_tables = torch.tensor([t.ids + [0] * (width - len(t.ids)) for t in tables], device=device)
        prefills = [PrefillChunk(row, row + end - start, end, torch.tensor(table.ids, device=device), start)
                    for table, start, end, row in chunks]
        empty = torch.empty(0, dtype=torch.long, device=device)
        return AttentionMetadata(empty, len(lens), decode_tables, None, prefills, decode_positions=[n - 1 for n in lens])
