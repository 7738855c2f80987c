"""BlockManager: the paged KV cache's bookkeeping (which block holds which tokens of which sequence).

The cache is a pool of fixed-size blocks. A sequence owns a block table (list of block ids).
Blocks are reference-counted so n > 1 samples share their prompt's full blocks. A full block is
hashed from its parent block's hash and its token ids; a later sequence with the same prefix reuses
it (after comparing the tokens, so a hash collision can never serve wrong K/V). Freed blocks keep
their contents and stay hittable until they are handed out again, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, Sequence


class PagedSequence(Protocol):
    """What the block manager needs from a sequence."""

    block_table: list[int]
    all_token_ids: list[int]
    num_cached_tokens: int
    num_hashed_blocks: int


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] = field(default=())


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    return hash((parent, tuple(token_ids)))


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, oldest-freed first; an OrderedDict gives O(1) removal on a cache hit.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash → block id
        self.prefix_queries = 0  # prompt blocks looked up
        self.prefix_hits = 0  # prompt blocks served from the cache
        self.peak_blocks_in_use = 0

    # ---- capacity ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation -------------------------------------------------------------------------

    def can_allocate(self, seq: PagedSequence) -> bool:
        return self.blocks_needed(len(seq.all_token_ids)) <= len(self.free)

    def allocate(self, seq: PagedSequence, reuse_prefix: bool = True) -> None:
        """Give seq blocks for all its current tokens, reusing cached full blocks of its longest prefix
        (unless reuse_prefix is False: fresh blocks for a from-scratch computation)."""
        assert not seq.block_table, "sequence already has blocks"
        tokens = seq.all_token_ids
        parent: int | None = None
        hitting = self.enable_prefix_caching and reuse_prefix
        seq.num_cached_tokens = seq.num_hashed_blocks = 0
        for start in range(0, len(tokens), self.block_size):
            chunk = tokens[start : start + self.block_size]
            full = len(chunk) == self.block_size
            block_id = None
            # The last token is always computed (its logits are needed), so never serve it from cache.
            if hitting and full and start + self.block_size < len(tokens):
                h = block_hash(parent, chunk)
                self.prefix_queries += 1
                block_id = self._lookup(h, chunk)
                parent = h
                if block_id is None:
                    hitting = False
                else:
                    self.prefix_hits += 1
                    seq.num_cached_tokens += self.block_size
                    seq.num_hashed_blocks += 1
            if block_id is None:
                block_id = self._take_free_block()
            else:
                self._ref(block_id)
            seq.block_table.append(block_id)

    def _lookup(self, h: int, chunk: Sequence[int]) -> int | None:
        block_id = self.cached.get(h)
        if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
            return None
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if not self.free:
            raise NoFreeBlocksError("no free KV cache block")
        block_id, _ = self.free.popitem(last=False)
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, len(self.blocks) - len(self.free))
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # evict: its contents are about to be overwritten
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def can_append(self, seq: PagedSequence) -> bool:
        """Room for one more token: either space in the last block or one free block."""
        return len(seq.all_token_ids) <= len(seq.block_table) * self.block_size or bool(self.free)

    def append_slot(self, seq: PagedSequence) -> None:
        """Make sure the block table covers every token (called before computing the newest one)."""
        while len(seq.block_table) * self.block_size < len(seq.all_token_ids):
            seq.block_table.append(self._take_free_block())

    def register_full_blocks(self, seq: PagedSequence, num_computed_tokens: int) -> None:
        """Hash every block whose tokens are all computed, so later requests can reuse it."""
        if not self.enable_prefix_caching:
            return
        tokens = seq.all_token_ids
        for index in range(seq.num_hashed_blocks, num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[index]]
            parent = self.blocks[seq.block_table[index - 1]].hash if index else None
            if block.hash is None:
                chunk = tokens[index * self.block_size : (index + 1) * self.block_size]
                block.hash, block.token_ids = block_hash(parent, chunk), tuple(chunk)
                self.cached.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_computed_tokens // self.block_size)

    def fork(self, parent: PagedSequence, child: PagedSequence) -> tuple[int, int] | None:
        """Child shares parent's full blocks; a partial last block is copied (copy-on-write done at once).
        Returns (source, destination) block ids the caller must copy, or None."""
        full = len(parent.all_token_ids) // self.block_size
        for block_id in parent.block_table[:full]:
            self._ref(block_id)
        child.block_table = list(parent.block_table[:full])
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        if full == len(parent.block_table):
            return None
        copy = self._take_free_block()
        child.block_table.append(copy)
        return parent.block_table[full], copy

    def free_sequence(self, seq: PagedSequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
