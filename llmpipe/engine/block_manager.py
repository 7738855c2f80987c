"""BlockManager: the paged KV cache's bookkeeping, coordinating one group manager per KV cache group
(kv_cache/kinds/) over the shared BlockPool. It knows no kind by name: what differs between full,
sliding-window and compressed groups lives in their specs and managers.

Blocks are given out per step, for the tokens scheduled. A prefix is reusable only as far as every
group still has the blocks its next query reads. Block copies (a prefix hit ending inside a block
of a group that spans several token blocks, a forked sample's partial last block) are queued and
handed to the runner with the next step's batch (`take_block_copies`), in one ordered queue with the offload
tier's saves and loads (kv_cache/offload_tier.py): a prefix the pool evicted but the tier keeps is a hit too,
its blocks taken fresh and loaded from the tier before the step's forward.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

from llmpipe.errors import InvalidRequestError
from llmpipe.kv_cache.block_pool import BlockPool, NoFreeBlocksError, block_hash
from llmpipe.kv_cache.kinds import BlockTable, KVCacheSpec
from llmpipe.kv_cache.offload_tier import LoadBlock, OffloadTier, SaveBlock

BlockTransfer = tuple[int, int] | SaveBlock | LoadBlock  # a copy (source, destination), or to / from the tier

__all__ = ["BlockManager", "BlockTable", "NoFreeBlocksError", "PagedSequence", "PrefixHit"]


class PagedSequence(Protocol):
    """What the block manager needs from a sequence."""

    block_tables: list[BlockTable]
    block_hashes: list[int]
    all_token_ids: list[int]
    num_computed_tokens: int
    num_cached_tokens: int
    num_hashed_blocks: int
    cache_salt: str | None  # seeds its blocks' hashes: prefixes under different salts never share blocks


@dataclass
class PrefixHit:
    num_tokens: int  # tokens served from the cache
    tables: list[BlockTable]  # per group, the cached blocks the sequence's next queries read
    # Per group, a cached block whose first rows hold the hit's last entries (the hit ends inside one of
    # the group's blocks): allocate() copies it into a block of the sequence's own.
    partials: list[int | None] = field(default_factory=list)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, specs: Sequence[KVCacheSpec], enable_prefix_caching: bool = True,
        copy_partial_blocks: bool = False, tier: OffloadTier | None = None,
    ):
        """specs: one per KV cache group.
        copy_partial_blocks: a prefix hit may end inside a block spanning several token blocks, whose
        cached rows are then copied (by the runner, see take_block_copies); otherwise hits cover whole blocks."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.copy_partial_blocks = copy_partial_blocks
        self.block_copies: list[BlockTransfer] = []  # for the next step, in order
        # the token blocks; a recurrent group's manager has a state pool of its own
        self.pool = BlockPool(num_blocks, tier=tier, transfers=self.block_copies)
        self.specs = list(specs)
        self.groups = [spec.manager(self.pool, group, block_size) for group, spec in enumerate(self.specs)]
        for group in self.groups:
            group.prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt blocks looked up
        self.prefix_hits = 0  # prompt blocks served from the cache

    # ---- capacity ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def peak_blocks_in_use(self) -> int:
        return self.pool.peak_blocks_in_use

    def take_block_copies(self) -> list[BlockTransfer]:
        """The block copies and tier transfers queued since the last call; the runner makes them in order before
        the step's forward (a source stays untouched until then: only a forward writes blocks)."""
        copies = list(self.block_copies)
        self.block_copies.clear()  # the same list: the pool queues into it
        return copies

    # ---- admission: prefix-cache lookup, then blocks for the first chunk ----------------------

    def prefix_hit(self, seq: PagedSequence) -> PrefixHit:
        """The longest cached prefix of seq's tokens that every group can serve (the last token is
        always computed: its logits are needed). Only looks; allocate() takes the blocks."""
        if not self.enable_prefix_caching:
            return self.no_hit()
        self.pool.forget_pending()
        tokens = seq.all_token_ids
        hashes = self._hashes(seq, (len(tokens) - 1) // self.block_size)
        k = self._round_hit(len(hashes))
        # A block some group needs for a k-block prefix and lacks is needed by every longer prefix
        # too (a window's first needed block only moves forward), so k drops below it.
        while k and (miss := max((m for g in self.groups if (m := g.highest_miss(hashes, tokens, k)) is not None),
                                 default=None)) is not None:
            k = self._round_hit(miss)
        tables, partials = zip(*(g.hit(hashes, tokens, k) for g in self.groups))
        return PrefixHit(k * self.block_size, list(tables), list(partials))

    def no_hit(self) -> PrefixHit:
        """Nothing served from the cache: every token is computed."""
        return PrefixHit(0, [group.empty_table() for group in self.groups])

    def _round_hit(self, k: int) -> int:
        """Without partial-block copies, a prefix of k token blocks cut to whole blocks of every group."""
        return k if self.copy_partial_blocks else k - k % math.lcm(*(spec.span for spec in self.specs))

    def can_allocate(self, seq: PagedSequence, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Room for the hit's blocks (those sitting in the free list leave it) and the first chunk."""
        start, held = hit.num_tokens, self.pool.tier is not None  # (sources held through allocate: see there)
        needs = [(g.pool, sum(b < 0 or g.pool.blocks[b - g.pool.first_id].ref_count == 0 for b in t.ids)
                  + g.missing(t, start, start + num_new_tokens)
                  + (held and s is not None and (s < 0 or g.pool.blocks[s - g.pool.first_id].ref_count == 0)))
                 for g, t, s in zip(self.groups, hit.tables, self._sources(hit))]
        return self._fits(needs)

    def _fits(self, needs: list[tuple[BlockPool, int]]) -> bool:
        """Whether each pool has the free blocks the groups drawing on it need."""
        totals: dict[BlockPool, int] = {}
        for pool, count in needs:
            totals[pool] = totals.get(pool, 0) + count
        return all(count <= pool.num_free_blocks for pool, count in totals.items())

    def allocate(self, seq: PagedSequence, hit: PrefixHit, num_new_tokens: int) -> None:
        """Take the hit's blocks and fresh ones for the next num_new_tokens tokens."""
        assert not seq.block_tables, "sequence already has blocks"
        sources = self._sources(hit)
        for group, table, source in zip(self.groups, hit.tables, sources):
            for block_id in table.ids:
                if block_id >= 0:
                    group.pool.ref(block_id)
            if source is not None and source >= 0 and self.pool.tier is not None:
                group.pool.ref(source)  # a tier's load into it, before the copy, would overwrite it: held until queued
        # Then the tier's blocks (negative handles): taking them can no longer evict a block of the hit.
        for group, table in zip(self.groups, hit.tables):
            table.ids = [group.pool.restore(b) if b < 0 else b for b in table.ids]
        sources = [group.pool.restore(s) if s is not None and s < 0 else s for group, s in zip(self.groups, sources)]
        seq.block_tables = hit.tables
        seq.num_cached_tokens = hit.num_tokens  # computed too: the scheduler counts them
        seq.num_hashed_blocks = hit.num_tokens // self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += (len(seq.all_token_ids) - 1) // self.block_size
            self.prefix_hits += seq.num_hashed_blocks
        self.reserve(seq, num_new_tokens, start=hit.num_tokens)
        for group, table, source in zip(self.groups, seq.block_tables, sources):
            own = group.copy_target(table, seq.num_hashed_blocks) if source is not None else None
            if own is not None and own != source:
                self.block_copies.append((source, own))
            if source is not None and self.pool.tier is not None:
                group.pool.release([source])  # stays listed: the copy is queued before anything can write it

    def _sources(self, hit: PrefixHit) -> list[int | None]:
        """Per group, the cached block a hit ending inside one of its blocks copies from (or None)."""
        return hit.partials or [None] * len(self.groups)

    # ---- each step: free what the windows left behind, add blocks for the scheduled tokens ----

    def free_unreachable(self, seq: PagedSequence) -> None:
        """Free every block no query from seq.num_computed_tokens on can read."""
        for group, table in zip(self.groups, seq.block_tables):
            group.release_unreachable(table, seq.num_computed_tokens)

    def can_reserve(self, seq: PagedSequence, num_new_tokens: int) -> bool:
        start = seq.num_computed_tokens
        return self._fits([(g.pool, g.missing(t, start, start + num_new_tokens)) for g, t in zip(self.groups, seq.block_tables)])

    def reserve(self, seq: PagedSequence, num_new_tokens: int, start: int | None = None) -> None:
        """Blocks for positions start (by default num_computed_tokens) .. + num_new_tokens - 1 in every group."""
        start = seq.num_computed_tokens if start is None else start
        for group, table in zip(self.groups, seq.block_tables):
            group.reserve(table, start, start + num_new_tokens)

    def trim(self, seq: PagedSequence, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens positions (a speculative step's rejected tail)."""
        for group, table in zip(self.groups, seq.block_tables):
            group.trim(table, num_tokens)

    def register_full_blocks(self, seq: PagedSequence, num_computed_tokens: int) -> None:
        """List every token block whose tokens are all computed, so later requests can reuse it."""
        if not self.enable_prefix_caching:
            return
        full = num_computed_tokens // self.block_size
        hashes = self._hashes(seq, full)
        tokens, size = seq.all_token_ids, self.block_size
        for index in range(seq.num_hashed_blocks, full):
            chunk = tuple(tokens[index * size : (index + 1) * size])
            for group, table in zip(self.groups, seq.block_tables):
                group.register(table, index, hashes[index], chunk)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def _hashes(self, seq: PagedSequence, count: int) -> list[int]:
        """Hashes of seq's first `count` full blocks, computed once per sequence."""
        hashes, tokens, size = seq.block_hashes, seq.all_token_ids, self.block_size
        while len(hashes) < count:
            index = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None, tokens[index * size : (index + 1) * size],
                                     seq.cache_salt))
        return hashes

    # ---- n > 1, release ----------------------------------------------------------------------

    def can_fork(self, parent: PagedSequence) -> bool:
        n = len(parent.all_token_ids)
        return self._fits([(g.pool, g.fork_cost(table, n)) for g, table in zip(self.groups, parent.block_tables)])

    def fork(self, parent: PagedSequence, child: PagedSequence) -> None:
        """Child shares parent's full blocks; a partial last block is copied (queued with the step's copies)."""
        n = len(parent.all_token_ids)
        child.block_tables = []
        for group, table in zip(self.groups, parent.block_tables):
            mine, copy = group.fork(table, n)
            child.block_tables.append(mine)
            if copy is not None:
                self.block_copies.append(copy)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_hashed_blocks = min(parent.num_hashed_blocks, n // self.block_size)

    def free_sequence(self, seq: PagedSequence) -> None:
        for group, table in zip(self.groups, seq.block_tables):
            group.pool.release(table.ids)
        seq.block_tables = []
        seq.num_hashed_blocks = 0

    def blocks_held(self, seq: PagedSequence) -> int:
        """Token blocks seq holds (states from a pool of their own: states_held)."""
        return sum(len(table.ids) for g, table in zip(self.groups, seq.block_tables) if g.pool is self.pool)

    def states_held(self, seq: PagedSequence) -> int:
        return sum(len(table.ids) for g, table in zip(self.groups, seq.block_tables) if g.pool is not self.pool)

    @property
    def states_in_use(self) -> int:
        """Per-sequence states held, over the state pools (live ones, and checkpoints a step is writing)."""
        pools = {g.pool for g in self.groups if g.pool is not self.pool}
        return sum(p.num_blocks - p.num_free_blocks for p in pools)

    @contextmanager
    def scratch(self, token_ids: list[int], make_copies: Callable[[list[tuple[int, int]]], None]) -> Iterator[list[BlockTable]]:
        """Block tables for token_ids outside the scheduler (scoring, calibration), freed on exit.
        `make_copies` makes the queued block copies first: a block the scratch takes may be one's source."""
        scratch = ScratchSequence(list(token_ids))
        no_hit = self.no_hit()  # computed from scratch
        make_copies(self.take_block_copies())
        if not self.can_allocate(scratch, no_hit, len(token_ids)):
            raise InvalidRequestError(f"{len(token_ids)} tokens do not fit the free KV cache blocks")
        self.allocate(scratch, no_hit, len(token_ids))
        try:
            yield scratch.block_tables
        finally:
            self.free_sequence(scratch)


@dataclass(eq=False)
class ScratchSequence:
    """The PagedSequence of a scratch allocation."""

    all_token_ids: list[int]
    block_tables: list[BlockTable] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_hashed_blocks: int = 0
    cache_salt: str | None = None
