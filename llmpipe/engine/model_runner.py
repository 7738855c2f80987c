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
        table = torch.tensor(block_table, device=self.device)
        positions = torch.arange(len(token_ids), device=self.device)
        chunk = PrefillChunk(0, len(token_ids), len(token_ids), table)
        meta = AttentionMetadata(self._slots(table, positions), 0, None, None, [chunk])
        ids = torch.tensor(token_ids, device=self.device)
        hidden = self.model(ids, positions, self.kv_cache.layers, meta)
        return self.model.compute_logits(hidden[-1:] if last_only else hidden)

    def _slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _prepare(self, batch: SchedulerOutput):
        ids: list[int] = [seq.all_token_ids[-1] for seq in batch.decodes]
        positions: list[int] = [seq.num_tokens - 1 for seq in batch.decodes]
        slots: list[torch.Tensor] = []
        decode_tables = decode_lens = None
        lens = [seq.num_tokens for seq in batch.decodes]
        if batch.decodes:
            width = max(len(seq.block_table) for seq in batch.decodes)
            padded = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.decodes]
            decode_tables = torch.tensor(padded, device=self.device)
            decode_lens = torch.tensor(lens, device=self.device)
            pos = decode_lens - 1
            slots.append(decode_tables.gather(1, (pos // self.block_size)[:, None])[:, 0] * self.block_size + pos % self.block_size)
        logit_rows = list(range(len(batch.decodes)))
        chunks = []
        for item in batch.prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            token_start = len(ids)
            ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = torch.tensor(seq.block_table, device=self.device)
            slots.append(self._slots(table, torch.arange(start, end, device=self.device)))
            chunks.append(PrefillChunk(token_start, len(ids), end, table))
            if item.completes_prefill:
                logit_rows.append(len(ids) - 1)
        meta = AttentionMetadata(
            torch.cat(slots), len(batch.decodes), decode_tables, decode_lens, chunks,
            decode_max_len=max(lens, default=0), decode_same_len=len(set(lens)) <= 1,
        )
        ids_t = torch.tensor(ids, device=self.device)
        return ids_t, torch.tensor(positions, device=self.device), meta, torch.tensor(logit_rows, dtype=torch.long, device=self.device)
