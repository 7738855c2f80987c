"""The prefix cache below the KV pool: a host-memory tier, and under it a disk tier (kv_cache/disk_tier.py) —
vLLM's KV offloading, LMCache, llama-server's --cache-ram, one level further down than the pool.

Store on compute: every block the prefix cache lists is copied here once, at the start of the step after the
one that completed it (`SaveBlock`, made by the runner before anything can write the block again), so a block
the pool evicts later is already saved and the disk tier holds what a restart needs. A lookup the pool misses
asks the tier (`find`); a hit comes back as a `LoadBlock` into a fresh block of the pool, made before the step's
forward, instead of recomputing the block's tokens. Entries are keyed by the pool's cache keys, which are stable
across processes (`block_pool.block_hash` is a digest), and confirmed by their tokens, as in the pool.

On a CPU the pool and this tier are both host memory: the tier is what a larger pool would be, bounded on its
own (`--kv-offload-memory`) and filled only with blocks worth keeping (listed, full ones), in the pool's layout.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from llmpipe.kv_cache.disk_tier import DiskTier

logger = logging.getLogger(__name__)

CacheKey = Hashable


@dataclass(eq=False)
class TierEntry:
    key: CacheKey
    tokens: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]  # the block's slice of each of the KV cache's storage tensors

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass(frozen=True, eq=False)
class SaveBlock:
    """Copy pool block `block_id` (listed under key, holding tokens) into the tier."""

    block_id: int
    key: CacheKey
    tokens: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class LoadBlock:
    """Write a tier entry into pool block `block_id`."""

    entry: TierEntry
    block_id: int


@dataclass
class TierStats:
    saved: int = 0  # blocks copied into the tier
    restored: int = 0  # blocks loaded back into the pool (from memory or disk)
    disk_reads: int = 0  # blocks read back from disk and verified
    rejected: int = 0  # disk files that failed verification (recomputed instead)


class OffloadTier:
    def __init__(self, memory_bytes: int, disk: DiskTier | None = None):
        """memory_bytes: the host tier's budget (least recently used entries leave first; with a disk tier
        they stay there). disk: the tier below, or None."""
        self.memory_bytes = memory_bytes
        self.disk = disk
        self.entries: OrderedDict[CacheKey, TierEntry] = OrderedDict()
        self.bytes = 0
        # Read from disk during the current prefix lookup but beyond the memory budget: a lookup asks for a block
        # more than once (the longest servable prefix first, then its blocks), and one read is enough.
        self.staged: dict[CacheKey, TierEntry] = {}
        self.stats = TierStats()

    def __contains__(self, key: CacheKey) -> bool:
        return key in self.entries or (self.disk is not None and key in self.disk)

    def put(self, key: CacheKey, tokens: tuple[int, ...], tensors: Sequence[torch.Tensor]) -> None:
        """Keep a copy of a block (tensors the caller no longer writes)."""
        if key in self:
            return
        entry = TierEntry(key, tokens, tuple(tensors))
        self.stats.saved += 1
        self._remember(entry)
        if self.disk is not None:
            self.disk.write(entry.key, entry.tokens, entry.tensors)

    def find(self, key: CacheKey, tokens: tuple[int, ...]) -> TierEntry | None:
        """The entry listed under key with these tokens: from memory, or read from disk and verified (a
        file that fails is dropped: its tokens are recomputed, never served)."""
        entry = self.entries.get(key) or self.staged.get(key)
        if entry is not None:
            if entry.tokens != tokens:
                return None
            if key in self.entries:
                self.entries.move_to_end(key)
            return entry
        if self.disk is None or key not in self.disk:
            return None
        tensors = self.disk.read(key, tokens)
        if tensors is None:
            self.stats.rejected += 1
            return None
        entry = TierEntry(key, tokens, tensors)
        self.stats.disk_reads += 1
        if not self._remember(entry):
            self.staged[key] = entry
        return entry

    def end_lookup(self) -> None:
        """A prefix lookup is over: what it read from disk beyond the memory budget is let go (a load it queued
        holds its own reference)."""
        self.staged.clear()

    def _remember(self, entry: TierEntry) -> bool:
        """Keep entry in memory, if it fits the budget at all."""
        if entry.nbytes > self.memory_bytes:
            return False
        self.entries[entry.key] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.memory_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
        return True

    def flush(self) -> None:
        """Wait until every block written to the disk tier is on disk."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
