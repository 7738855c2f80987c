"""Compressed attention (a DeepSeek-V4-style cache): one row per `ratio` tokens, so one block of
block_size × block_rows rows spans block_size × block_rows × ratio tokens and is never freed while the
sequence runs.

A block still filling is listed under each of its token blocks' hashes as a partial entry: a prefix hit
that ends inside it brings a copy of it (the new sequence goes on writing its later rows), which the
coordinator hands to the runner with the step's other block copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from llmpipe.kv_cache.block_pool import BlockPool
from llmpipe.kv_cache.kinds.base import BlockTable, GroupBatch, GroupManager, KVCacheSpec

PARTIAL = "partial"  # the cache key's tag of a block listed while it fills


@dataclass
class CompressedMetadata:
    """A compressed group's whole block tables (its layers write the rows they pool themselves)."""

    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [decode rows, max blocks], padded with 0
    prefill_block_tables: list[torch.Tensor] = field(default_factory=list)  # per prefill chunk


@dataclass(frozen=True)
class CompressedSpec(KVCacheSpec):
    ratio: int  # tokens per row
    block_rows: int = 1  # a block holds block_size × block_rows rows per layer (narrow rows fill a wide page)
    window = None

    @property
    def name(self) -> str:
        return f"compressed({self.ratio})"

    @property
    def span(self) -> int:
        return self.ratio * self.block_rows

    def manager(self, pool: BlockPool, group: int, block_size: int) -> GroupManager:
        return CompressedManager(self, pool, group, block_size)

    def metadata(self, batch: GroupBatch, block_size: int, device: torch.device) -> CompressedMetadata:
        decode_tables = None
        if batch.tables:
            width = max(len(t.ids) for t in batch.tables)
            decode_tables = torch.tensor([t.ids + [0] * (width - len(t.ids)) for t in batch.tables], device=device)
        chunks = [torch.tensor(table.ids, device=device) for table, _, _, _ in batch.chunks]
        return CompressedMetadata(len(batch.lens), decode_tables, chunks)


class CompressedManager(GroupManager):
    def lookup_partial(self, index: int, hashes: list[int], tokens: Sequence[int]) -> int | None:
        """A block still filling whose rows are final up to token block `index` of this prefix."""
        size = self.block_size
        return self.pool.lookup((self.group, hashes[index], PARTIAL), tuple(tokens[index * size : (index + 1) * size]))

    def highest_miss(self, hashes: list[int], tokens: Sequence[int], k: int) -> int | None:
        miss = super().highest_miss(hashes, tokens, k)
        if miss is None and k % self.spec.span and self.lookup_partial(k - 1, hashes, tokens) is None:
            return k - 1  # no cached block holds this group's rows up to token block k - 1
        return miss

    def hit(self, hashes: list[int], tokens: Sequence[int], k: int) -> tuple[BlockTable, int | None]:
        table, _ = super().hit(hashes, tokens, k)
        return table, self.lookup_partial(k - 1, hashes, tokens) if k % self.spec.span else None

    def register(self, table: BlockTable, index: int, key_hash: int, chunk: tuple[int, ...]) -> None:
        j = index // self.spec.span
        if (index + 1) % self.spec.span and table.offset <= j < len(table):
            self.pool.list_block(table.ids[j - table.offset], (self.group, key_hash, PARTIAL), chunk, offload=False)
        else:
            super().register(table, index, key_hash, chunk)
