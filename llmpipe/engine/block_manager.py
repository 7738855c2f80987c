"""BlockManager: the paged KV cache's bookkeeping (which block holds which tokens of which sequence).

The cache is one pool of fixed-size blocks shared by the KV cache groups (engine/kv_cache_spec.py).
A sequence owns one block table per group. Blocks are reference-counted so n > 1 samples share
their prompt's full blocks. A full block is hashed from its parent block's hash and its token ids;
a later sequence with the same prefix reuses it (after comparing the tokens, so a hash collision
can never serve wrong K/V). Freed blocks keep their contents and stay hittable until they are
handed out again, least recently freed first.

A compressed group's block (DeepSeek V4: one row per `ratio` tokens) spans several token blocks; while it
fills it is listed under each of their hashes, and a hit that ends inside it gets a copy of it
(`copy_block`), since the new sequence goes on writing its later rows.

Blocks are given out per step, for the tokens scheduled. A sliding-window group frees the blocks
that no later query of the sequence can reach, so its table starts at an offset; a prefix is
reusable only as far as every group still has the blocks its next query reads.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from llmpipe.engine.kv_cache_spec import KVCacheSpec


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


class PagedSequence(Protocol):
    """What the block manager needs from a sequence."""

    block_tables: list[BlockTable]
    block_hashes: list[int]
    all_token_ids: list[int]
    num_computed_tokens: int
    num_cached_tokens: int
    num_hashed_blocks: int


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in its group's prefix cache
    token_ids: tuple[int, ...] = field(default=())
    group: int = 0  # the group whose prefix cache lists it
    # A compressed group's block, listed while it fills: token-block hash → that token block's ids.
    partials: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class PrefixHit:
    num_tokens: int  # tokens served from the cache
    tables: list[BlockTable]  # per group, the cached blocks the sequence's next queries read
    # Per group, a cached block whose first rows hold the hit's last entries (a compressed block the
    # hit ends inside): allocate() copies it into a block of the sequence's own.
    partials: list[int | None] = field(default_factory=list)


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    return hash((parent, tuple(token_ids)))


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        specs: Sequence[KVCacheSpec] = (KVCacheSpec(None),),
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.specs = list(specs)  # one per KV cache group
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, oldest-freed first; an OrderedDict gives O(1) removal on a cache hit.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: list[dict[int, int]] = [{} for _ in self.specs]  # per group: block hash → block id
        self.partial: list[dict[int, int]] = [{} for _ in self.specs]  # per group: hash → compressed block filling
        # Copies one block's contents to another (the KV cache's): set, prefix hits may end inside a
        # compressed group's block, whose cached rows are then copied; unset, hits cover whole blocks.
        self.copy_block: Callable[[int, int], None] | None = None
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

    def _span(self, spec: KVCacheSpec, start: int, end: int) -> tuple[int, int]:
        """Blocks [first, last) that computing positions start..end-1 reads or writes."""
        return spec.first_needed_block(start, self.block_size), -(-end // spec.tokens_per_block(self.block_size))

    def _missing(self, spec: KVCacheSpec, table: BlockTable, start: int, end: int) -> int:
        first, last = self._span(spec, start, end)
        return max(0, table.offset - first) + max(0, last - max(len(table), first))  # as reserve() adds them

    # ---- admission: prefix-cache lookup, then blocks for the first chunk ----------------------

    def prefix_hit(self, seq: PagedSequence) -> PrefixHit:
        """The longest cached prefix of seq's tokens that every group can serve (the last token is
        always computed: its logits are needed). Only looks; allocate() takes the blocks."""
        if not self.enable_prefix_caching:
            return self.no_hit()
        hashes = self._hashes(seq, (len(seq.all_token_ids) - 1) // self.block_size)
        k = self._round_hit(len(hashes))
        # A block some group needs for a k-block prefix and lacks is needed by every longer prefix
        # too (a window's first needed block only moves forward), so k drops below it.
        while k and (miss := self._highest_miss(seq, hashes, k)) is not None:
            k = self._round_hit(miss)
        tables, partials = [], []
        for group, spec in enumerate(self.specs):
            first = spec.first_needed_block(k * self.block_size, self.block_size)
            ids = [self._lookup(group, (j + 1) * spec.span - 1, hashes, seq) for j in range(first, k // spec.span)]
            tables.append(BlockTable(first, ids))
            partials.append(self._lookup_partial(group, k - 1, hashes, seq) if k % spec.span else None)
        return PrefixHit(k * self.block_size, tables, partials)

    def no_hit(self) -> PrefixHit:
        """Nothing served from the cache: every token is computed."""
        return PrefixHit(0, [BlockTable() for _ in self.specs])

    def _round_hit(self, k: int) -> int:
        """Without copy_block, a prefix of k token blocks cut to whole blocks of every compressed group
        (a partly filled block of entries would be written by the new sequence while others read it)."""
        return k if self.copy_block is not None else k - k % math.lcm(*(spec.span for spec in self.specs))

    def _highest_miss(self, seq: PagedSequence, hashes: list[int], k: int) -> int | None:
        """The longest prefix (token blocks) short of k that the highest missing block allows, if one is missing.
        A group's block j holds token blocks j·span … (j+1)·span − 1 and is cached under the last one's hash."""
        misses = []
        for group, spec in enumerate(self.specs):
            first, r = spec.first_needed_block(k * self.block_size, self.block_size), spec.span
            missing = (j for j in range(k // r - 1, first - 1, -1)
                       if self._lookup(group, (j + 1) * r - 1, hashes, seq) is None)
            miss = next((j * r for j in missing), None)
            if miss is None and k % r and self._lookup_partial(group, k - 1, hashes, seq) is None:
                miss = k - 1  # no cached block holds this group's entries up to token block k - 1
            misses.append(miss)
        return max((m for m in misses if m is not None), default=None)

    def _lookup(self, group: int, index: int, hashes: list[int], seq: PagedSequence) -> int | None:
        block_id = self.cached[group].get(hashes[index])
        if block_id is None:
            return None
        chunk = seq.all_token_ids[index * self.block_size : (index + 1) * self.block_size]
        return block_id if self.blocks[block_id].token_ids == tuple(chunk) else None

    def _lookup_partial(self, group: int, index: int, hashes: list[int], seq: PagedSequence) -> int | None:
        """A compressed block whose rows are final up to token block `index` of this prefix."""
        block_id = self.partial[group].get(hashes[index])
        chunk = tuple(seq.all_token_ids[index * self.block_size : (index + 1) * self.block_size])
        return block_id if block_id is not None and self.blocks[block_id].partials.get(hashes[index]) == chunk else None

    def can_allocate(self, seq: PagedSequence, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Room for the hit's blocks (those sitting in the free list leave it) and the first chunk."""
        start = hit.num_tokens
        taken = sum(self.blocks[b].ref_count == 0 for table in hit.tables for b in table.ids)
        new = sum(self._missing(s, t, start, start + num_new_tokens) for s, t in zip(self.specs, hit.tables))
        return taken + new <= len(self.free)

    def allocate(self, seq: PagedSequence, hit: PrefixHit, num_new_tokens: int) -> None:
        """Take the hit's blocks and fresh ones for the next num_new_tokens tokens."""
        assert not seq.block_tables, "sequence already has blocks"
        for table in hit.tables:
            for block_id in table.ids:
                self._ref(block_id)
        seq.block_tables = hit.tables
        seq.num_cached_tokens = seq.num_computed_tokens = hit.num_tokens
        seq.num_hashed_blocks = hit.num_tokens // self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += (len(seq.all_token_ids) - 1) // self.block_size
            self.prefix_hits += seq.num_hashed_blocks
        self.reserve(seq, num_new_tokens)
        # The source of a partial block is untouched until the next forward writes, even if it was just handed out.
        for spec, table, source in zip(self.specs, seq.block_tables, hit.partials):
            own = table.ids[seq.num_hashed_blocks // spec.span - table.offset] if source is not None else None
            if own is not None and own != source:
                self.copy_block(source, own)

    # ---- each step: free what the window left behind, add blocks for the scheduled tokens -----

    def free_out_of_window(self, seq: PagedSequence) -> None:
        """Free every block no query from seq.num_computed_tokens on can read (window groups only)."""
        for spec, table in zip(self.specs, seq.block_tables):
            first = spec.first_needed_block(seq.num_computed_tokens, self.block_size)
            if first > table.offset:
                drop = min(first, len(table)) - table.offset
                self._release(table.ids[:drop])
                table.ids, table.offset = table.ids[drop:], table.offset + drop

    def can_reserve(self, seq: PagedSequence, num_new_tokens: int) -> bool:
        start = seq.num_computed_tokens
        new = sum(self._missing(s, t, start, start + num_new_tokens) for s, t in zip(self.specs, seq.block_tables))
        return new <= len(self.free)

    def reserve(self, seq: PagedSequence, num_new_tokens: int) -> None:
        """Blocks for positions num_computed_tokens .. + num_new_tokens - 1 in every group (and the
        window before them). A table that starts past what is needed (a recomputation) grows back."""
        start = seq.num_computed_tokens
        for spec, table in zip(self.specs, seq.block_tables):
            first, last = self._span(spec, start, start + num_new_tokens)
            if first < table.offset:
                table.ids[:0] = [self._take_free_block() for _ in range(table.offset - first)]
                table.offset = first
            while len(table) < last:
                table.ids.append(self._take_free_block())

    def trim(self, seq: PagedSequence, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens positions (a speculative step's rejected tail)."""
        for spec, table in zip(self.specs, seq.block_tables):
            keep = max(0, -(-num_tokens // spec.tokens_per_block(self.block_size)) - table.offset)
            self._release(table.ids[keep:])
            del table.ids[keep:]

    def register_full_blocks(self, seq: PagedSequence, num_computed_tokens: int) -> None:
        """Hash every held block whose tokens are all computed, so later requests can reuse it."""
        if not self.enable_prefix_caching:
            return
        full = num_computed_tokens // self.block_size
        hashes = self._hashes(seq, full)
        tokens, size = seq.all_token_ids, self.block_size
        for index in range(seq.num_hashed_blocks, full):
            chunk = tuple(tokens[index * size : (index + 1) * size])
            for group, (spec, table) in enumerate(zip(self.specs, seq.block_tables)):
                j = index // spec.span
                if not table.offset <= j < len(table):
                    continue
                block = self.blocks[table.ids[j - table.offset]]
                if (index + 1) % spec.span:  # a compressed block still filling: listed for copy-on-hit
                    block.partials[hashes[index]], block.group = chunk, group
                    self.partial[group].setdefault(hashes[index], block.block_id)
                elif block.hash is None:
                    block.hash, block.token_ids, block.group = hashes[index], chunk, group
                    self.cached[group].setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def _hashes(self, seq: PagedSequence, count: int) -> list[int]:
        """Hashes of seq's first `count` full blocks, computed once per sequence."""
        hashes, tokens, size = seq.block_hashes, seq.all_token_ids, self.block_size
        while len(hashes) < count:
            index = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None, tokens[index * size : (index + 1) * size]))
        return hashes

    # ---- n > 1, release ----------------------------------------------------------------------

    def _full_blocks(self, seq: PagedSequence) -> list[int]:
        """Per group, how many of seq's blocks its tokens fill."""
        return [len(seq.all_token_ids) // spec.tokens_per_block(self.block_size) for spec in self.specs]

    def can_fork(self, parent: PagedSequence) -> bool:
        fulls = self._full_blocks(parent)
        return sum(len(table) > full for table, full in zip(parent.block_tables, fulls)) <= len(self.free)

    def fork(self, parent: PagedSequence, child: PagedSequence) -> list[tuple[int, int]]:
        """Child shares parent's full blocks; a partial last block is copied (copy-on-write done at once).
        Returns the (source, destination) block ids the caller must copy."""
        full = len(parent.all_token_ids) // self.block_size
        copies = []
        child.block_tables = []
        for table, group_full in zip(parent.block_tables, self._full_blocks(parent)):
            shared = table.ids[: max(0, group_full - table.offset)]
            for block_id in shared:
                self._ref(block_id)
            mine = BlockTable(table.offset, list(shared))
            if len(table) > max(group_full, table.offset):
                mine.ids.append(self._take_free_block())
                copies.append((table.ids[-1], mine.ids[-1]))
            child.block_tables.append(mine)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        return copies

    def free_sequence(self, seq: PagedSequence) -> None:
        for table in seq.block_tables:
            self._release(table.ids)
        seq.block_tables = []
        seq.num_hashed_blocks = 0

    def blocks_held(self, seq: PagedSequence) -> int:
        return sum(len(table.ids) for table in seq.block_tables)

    # ---- the free list -----------------------------------------------------------------------

    def _release(self, block_ids: list[int]) -> None:
        """Drop one reference to each; the last blocks of a sequence are freed first, so its prefix
        is the last to be evicted."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

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
        if block.hash is not None and self.cached[block.group].get(block.hash) == block_id:
            del self.cached[block.group][block.hash]  # evict: its contents are about to be overwritten
        for h in block.partials:
            if self.partial[block.group].get(h) == block_id:
                del self.partial[block.group][h]
        block.hash, block.token_ids, block.ref_count, block.partials = None, (), 1, {}
        return block_id
