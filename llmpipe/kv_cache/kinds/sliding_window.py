"""Sliding-window attention: a query reads the last `window` tokens, so a sequence frees the blocks its
later queries can no longer reach while it goes on, and its table starts at an offset."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmpipe.kv_cache.block_pool import BlockPool
from llmpipe.kv_cache.kinds.base import BlockTable, GroupBatch, GroupManager, KVCacheSpec
from llmpipe.kv_cache.kinds.full_attention import paged_metadata
from llmpipe.layers.attention import AttentionMetadata


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    window: int

    @property
    def name(self) -> str:
        return f"sliding_window({self.window})"

    @property
    def grows(self) -> bool:
        return False

    def first_needed_block(self, position: int, block_size: int) -> int:
        return max(0, position - self.window + 1) // block_size

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        return min(-(-num_tokens // block_size), -(-(self.window + chunk) // block_size) + 1)

    def manager(self, pool: BlockPool, group: int, block_size: int) -> GroupManager:
        return SlidingWindowManager(self, pool, group, block_size)

    def metadata(self, batch: GroupBatch, block_size: int, device: torch.device) -> AttentionMetadata:
        return paged_metadata(self, batch, block_size, device)


class SlidingWindowManager(GroupManager):
    def release_unreachable(self, table: BlockTable, num_computed_tokens: int) -> None:
        first = self.spec.first_needed_block(num_computed_tokens, self.block_size)
        if first > table.offset:
            drop = min(first, len(table)) - table.offset
            self.pool.release(table.ids[:drop])
            table.ids, table.offset = table.ids[drop:], table.offset + drop
