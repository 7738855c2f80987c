"""ModelRunner: flattens a scheduled batch into tensors (token ids, positions, slot mapping, block
tables → AttentionMetadata), runs one forward pass, and returns the logits that need sampling."""

from __future__ import annotations

import torch
from torch import nn

from llmpipe.config import EngineConfig
from llmpipe.engine.kv_cache import PagedKVCache
from llmpipe.engine.scheduler import SchedulerOutput
from llmpipe.layers.attention import AttentionMetadata, PrefillChunk

class ModelRunner:
    def __init__(self, model: nn.Module, config: EngineConfig, num_blocks: int):
        self.model = model
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.kv_cache = PagedKVCache(config.model_config, num_blocks, config.block_size, config.torch_dtype, self.device)

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> torch.Tensor:
        """Logits [rows, vocab]: one row per decode, then one per prefill chunk that ends its prefill."""
        ids, positions, meta, logit_rows = self._prepare(batch)
        hidden = self.model(ids, positions, self.kv_cache.layers, meta)
        return self.model.compute_logits(hidden[logit_rows])

    @torch.inference_mode()
    def score(self, token_ids: list[int], block_table: list[int], last_only: bool = False) -> torch.Tensor:
        """Logits [T, vocab] at every position (or [1, vocab] at the last) of a sequence computed
        from scratch into block_table."""
        slots, chunk = self._chunk(block_table, 0, len(token_ids), token_start=0)
        meta = AttentionMetadata(slots, 0, None, None, [chunk])
        ids = torch.tensor(token_ids, device=self.device)
        hidden = self.model(ids, torch.arange(len(token_ids), device=self.device), self.kv_cache.layers, meta)
        return self.model.compute_logits(hidden[-1:] if last_only else hidden)

    def _chunk(self, block_table: list[int], start: int, end: int, token_start: int) -> tuple[torch.Tensor, PrefillChunk]:
        """Cache slots of positions start..end of a sequence, and its prefill-chunk metadata."""
        table = torch.tensor(block_table, device=self.device)
        positions = torch.arange(start, end, device=self.device)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        return slots, PrefillChunk(token_start, token_start + end - start, end, table)

    def _prepare(self, batch: SchedulerOutput):
        ids: list[int] = [seq.all_token_ids[-1] for seq in batch.decodes]
        positions: list[int] = [seq.num_tokens - 1 for seq in batch.decodes]
        size = self.block_size
        decode_slots = [seq.block_table[p // size] * size + p % size for seq, p in zip(batch.decodes, positions)]
        slots: list[torch.Tensor] = [torch.tensor(decode_slots, dtype=torch.long, device=self.device)]
        decode_tables = decode_lens = None
        lens = [seq.num_tokens for seq in batch.decodes]
        if batch.decodes:
            width = max(len(seq.block_table) for seq in batch.decodes)
            padded = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.decodes]
            decode_tables = torch.tensor(padded, device=self.device)
            decode_lens = torch.tensor(lens, device=self.device)
        logit_rows = list(range(len(batch.decodes)))
        chunks = []
        for item in batch.prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            chunk_slots, chunk = self._chunk(seq.block_table, start, end, token_start=len(ids))
            ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.append(chunk_slots)
            chunks.append(chunk)
            if item.completes_prefill:
                logit_rows.append(len(ids) - 1)
        meta = AttentionMetadata(
            torch.cat(slots), len(batch.decodes), decode_tables, decode_lens, chunks,
            decode_max_len=max(lens, default=0), decode_same_len=len(set(lens)) <= 1,
        )
        ids_t = torch.tensor(ids, device=self.device)
        return ids_t, torch.tensor(positions, device=self.device), meta, torch.tensor(logit_rows, dtype=torch.long, device=self.device)
