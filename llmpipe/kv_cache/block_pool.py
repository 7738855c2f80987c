"""BlockPool: the KV cache's blocks — a free list, reference counts, and the prefix cache's index.

Blocks are reference-counted so n > 1 samples share their prompt's full blocks. A block a group
manager lists for reuse is indexed under a cache key (its group and the hash of the token block it
ends with) together with those tokens, so a hash collision can never serve wrong K/V. Freed blocks
keep their contents and stay hittable until they are handed out again, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Sequence

CacheKey = Hashable


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    listed: dict[CacheKey, tuple[int, ...]] = field(default_factory=dict)  # keys it is cached under → their tokens


class NoFreeBlocksError(RuntimeError):
    pass


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    return hash((parent, tuple(token_ids)))


class BlockPool:
    def __init__(self, num_blocks: int, first_id: int = 0):
        """Blocks first_id ... first_id + num_blocks - 1 (a second pool's ids follow the first's)."""
        self.first_id = first_id
        self.blocks = [Block(first_id + i) for i in range(num_blocks)]
        # Blocks with ref_count 0, oldest-freed first; an OrderedDict gives O(1) removal on a cache hit.
        self.free: OrderedDict[int, None] = OrderedDict((first_id + i, None) for i in range(num_blocks))
        self.cached: dict[CacheKey, int] = {}
        self.peak_blocks_in_use = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def take(self) -> int:
        """A free block, evicted from the prefix cache (its contents are about to be overwritten)."""
        if not self.free:
            raise NoFreeBlocksError("no free KV cache block")
        block_id, _ = self.free.popitem(last=False)
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, len(self.blocks) - len(self.free))
        block = self.blocks[block_id - self.first_id]
        for key in block.listed:
            del self.cached[key]
        block.listed, block.ref_count = {}, 1
        return block_id

    def ref(self, block_id: int) -> None:
        block = self.blocks[block_id - self.first_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each; the last blocks of a sequence are freed first, so its prefix is
        the last to be evicted."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id - self.first_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

    def list_block(self, block_id: int, key: CacheKey, tokens: tuple[int, ...]) -> None:
        """Index a block for reuse under key (the first block listed under a key keeps it)."""
        if key not in self.cached:
            self.cached[key] = block_id
            self.blocks[block_id - self.first_id].listed[key] = tokens

    def lookup(self, key: CacheKey, tokens: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(key)
        return block_id if block_id is not None and self.blocks[block_id - self.first_id].listed[key] == tokens else None
