"""A KV-cache kind: what a group of layers keeps (its spec), how a sequence's blocks of that group are
given out, reused and freed (its group manager), and what the group's layers receive for a step (its
metadata) — vLLM v1's KVCacheSpec and single-type manager, one class each per kind.

A kind's blocks come from the shared BlockPool (kv_cache/block_pool.py). A sequence has one BlockTable per
group; ids[i] holds the group's block offset + i, where blocks below the offset were freed (a window
the queries left behind). A block spans `span` token blocks of block_size tokens (1 for K/V per token;
more for kinds that keep a row per several tokens). Prefix reuse is by token block: the hash of token
block i (its tokens and its parent's hash) names the group's block that ends with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from llmpipe.kv_cache.block_pool import BlockPool


@dataclass
class BlockTable:
    """One group's blocks of a sequence: ids[i] holds tokens of block offset + i; blocks below the
    offset fell out of the group's window and were freed."""

    offset: int = 0
    ids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return self.offset + len(self.ids)

    def block_of(self, position: int, block_size: int) -> int:
        return self.ids[position // block_size - self.offset]


ChunkRows = tuple[BlockTable, int, int, int]  # a prefill chunk's table, start, end, first row in the batch


@dataclass
class GroupBatch:
    """One group's view of a step: per decode row its table and context length (tokens cached after
    the row, its own included), then the prefill chunks."""

    tables: list[BlockTable]
    lens: list[int]
    chunks: list[ChunkRows]


@dataclass(frozen=True)
class KVCacheSpec:
    """What one kind of layer keeps. Subclasses are frozen dataclasses (equal specs share groups) with a
    `window`: how far back a query reads (None: to the first token)."""

    per_sequence = False  # True: a fixed state per sequence from a pool of its own, not token blocks (recurrent.py)

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def span(self) -> int:
        """Token blocks (of block_size tokens) one block of this kind covers."""
        return 1

    @property
    def grows(self) -> bool:
        """Whether a sequence's blocks of this kind keep growing with its length."""
        return True

    def tokens_per_block(self, block_size: int) -> int:
        return block_size * self.span

    def first_needed_block(self, position: int, block_size: int) -> int:
        """Lowest block a query at `position`, or at any later position, still reads."""
        return 0

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of num_tokens computed tokens holds between steps (the next query is at num_tokens)."""
        return -(-num_tokens // self.tokens_per_block(block_size)) - self.first_needed_block(num_tokens, block_size)

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one sequence of num_tokens tokens holds at once, prefilled in chunks of `chunk` tokens."""
        return -(-num_tokens // self.tokens_per_block(block_size))

    def manager(self, pool: "BlockPool", group: int, block_size: int) -> "GroupManager":
        return GroupManager(self, pool, group, block_size)

    def metadata(self, batch: GroupBatch, block_size: int, device: torch.device) -> Any:
        """What the group's layers read for this step (each kind its own type)."""
        raise NotImplementedError


class GroupManager:
    """One group's blocks of every sequence, over the shared pool. The base keeps every block until
    the sequence ends (full attention); kinds override what differs."""

    prefix_caching = True  # the block manager's setting (a kind that copies state for the cache copies none without)

    def __init__(self, spec: KVCacheSpec, pool: "BlockPool", group: int, block_size: int):
        self.spec, self.pool, self.group, self.block_size = spec, pool, group, block_size

    def empty_table(self) -> BlockTable:
        """A sequence's table before it holds anything."""
        return BlockTable()

    # ---- blocks for the scheduled tokens -----------------------------------------------------

    def needed(self, start: int, end: int) -> tuple[int, int]:
        """Blocks [first, last) that computing positions start..end-1 reads or writes."""
        return self.spec.first_needed_block(start, self.block_size), -(-end // self.spec.tokens_per_block(self.block_size))

    def missing(self, table: BlockTable, start: int, end: int) -> int:
        first, last = self.needed(start, end)
        return max(0, table.offset - first) + max(0, last - max(len(table), first))  # as reserve() adds them

    def reserve(self, table: BlockTable, start: int, end: int) -> None:
        """Blocks for positions start..end-1 (and what they read before them). A table that starts
        past what is needed (a recomputation) grows back."""
        first, last = self.needed(start, end)
        if first < table.offset:
            table.ids[:0] = [self.pool.take() for _ in range(table.offset - first)]
            table.offset = first
        while len(table) < last:
            table.ids.append(self.pool.take())

    def release_unreachable(self, table: BlockTable, num_computed_tokens: int) -> None:
        """Free the blocks no query from num_computed_tokens on reads (none, for full attention)."""

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens positions."""
        keep = max(0, -(-num_tokens // self.spec.tokens_per_block(self.block_size)) - table.offset)
        self.pool.release(table.ids[keep:])
        del table.ids[keep:]

    def full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.spec.tokens_per_block(self.block_size)

    def fork_cost(self, table: BlockTable, num_tokens: int) -> int:
        """Blocks a fork of a num_tokens-token sequence takes: a copy of a partial last block."""
        return int(len(table) > max(self.full_blocks(num_tokens), table.offset))

    def fork(self, table: BlockTable, num_tokens: int) -> tuple[BlockTable, tuple[int, int] | None]:
        """A child's table sharing the full blocks; a partial last block gets a copy of its own:
        (table, (source, destination) or None)."""
        full = self.full_blocks(num_tokens)
        shared = table.ids[: max(0, full - table.offset)]
        for block_id in shared:
            self.pool.ref(block_id)
        mine = BlockTable(table.offset, list(shared))
        if len(table) > max(full, table.offset):
            mine.ids.append(self.pool.take())
            return mine, (table.ids[-1], mine.ids[-1])
        return mine, None

    # ---- the prefix cache --------------------------------------------------------------------

    def copy_target(self, table: BlockTable, num_hashed_blocks: int) -> int:
        """The block of a sequence's own that a prefix hit's partial block (hit()) is copied into."""
        return table.ids[num_hashed_blocks // self.spec.span - table.offset]

    def lookup(self, index: int, hashes: list[int], tokens: Sequence[int]) -> int | None:
        """The cached block that ends with token block `index` of this prefix."""
        size = self.block_size
        return self.pool.lookup((self.group, hashes[index]), tuple(tokens[index * size : (index + 1) * size]))

    def highest_miss(self, hashes: list[int], tokens: Sequence[int], k: int) -> int | None:
        """If a block a k-token-block prefix needs is not cached, the longest prefix (token blocks) short
        of k that the highest such block allows. Block j is cached under its last token block's hash."""
        first, r = self.spec.first_needed_block(k * self.block_size, self.block_size), self.spec.span
        missing = (j for j in range(k // r - 1, first - 1, -1) if self.lookup((j + 1) * r - 1, hashes, tokens) is None)
        return next((j * r for j in missing), None)

    def hit(self, hashes: list[int], tokens: Sequence[int], k: int) -> tuple[BlockTable, int | None]:
        """The cached blocks a k-token-block prefix's next queries read, and a cached block to copy
        where the prefix ends inside one of this kind's blocks (None: it ends on a block boundary)."""
        first, r = self.spec.first_needed_block(k * self.block_size, self.block_size), self.spec.span
        return BlockTable(first, [self.lookup((j + 1) * r - 1, hashes, tokens) for j in range(first, k // r)]), None

    def register(self, table: BlockTable, index: int, key_hash: int, chunk: tuple[int, ...]) -> None:
        """Token block `index` (hash, tokens) is computed: list the block it completes for reuse."""
        j = index // self.spec.span
        if table.offset <= j < len(table) and (index + 1) % self.spec.span == 0:
            self.pool.list_block(table.ids[j - table.offset], (self.group, key_hash), chunk)
