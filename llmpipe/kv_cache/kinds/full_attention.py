"""Full attention: every query reads every earlier token, so a sequence keeps all its blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmpipe.kv_cache.kinds.base import GroupBatch, KVCacheSpec
from llmpipe.layers.attention import AttentionMetadata, PrefillChunk


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    name = "full"
    window = None

    def metadata(self, batch: GroupBatch, block_size: int, device: torch.device) -> AttentionMetadata:
        return paged_metadata(self, batch, block_size, device)


def paged_metadata(spec: KVCacheSpec, batch: GroupBatch, block_size: int, device: torch.device) -> AttentionMetadata:
    """K/V per token (full or windowed attention): block tables cut down to the blocks the queries still
    read, context lengths counted from the first of them (window masks depend only on distances)."""
    size, tables, lens = block_size, batch.tables, batch.lens
    slots = [torch.tensor([t.block_of(n - 1, size) * size + (n - 1) % size for t, n in zip(tables, lens)],
                          dtype=torch.long, device=device)]
    decode_tables = decode_lens = None
    firsts = [spec.first_needed_block(n - 1, size) for n in lens]
    local_lens = [n - first * size for n, first in zip(lens, firsts)]
    if tables:
        rows = [t.ids[first - t.offset :] for t, first in zip(tables, firsts)]
        width = max(map(len, rows))
        decode_tables = torch.tensor([row + [0] * (width - len(row)) for row in rows], device=device)
        decode_lens = torch.tensor(local_lens, device=device)
    prefills = []
    for table, start, end, row in batch.chunks:
        first = spec.first_needed_block(start, size)
        blocks = torch.tensor(table.ids[first - table.offset : -(-end // size) - table.offset], device=device)
        local = torch.arange(start - first * size, end - first * size, device=device)
        slots.append(blocks[local // size] * size + local % size)
        prefills.append(PrefillChunk(row, row + end - start, end - first * size, blocks))
    return AttentionMetadata(
        torch.cat(slots), len(lens), decode_tables, decode_lens, prefills,
        decode_max_len=max(local_lens, default=0), decode_same_len=len(set(local_lens)) <= 1,
    )
