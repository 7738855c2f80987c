"""BlockPool: the KV cache's blocks — a free list, reference counts, and the prefix cache's index.

Blocks are reference-counted so n > 1 samples share their prompt's full blocks. A block a group
manager lists for reuse is indexed under a cache key (its group and the hash of the token block it
ends with) together with those tokens, so a hash collision can never serve wrong K/V. Freed blocks
keep their contents and stay hittable until they are handed out again, least recently freed first.

With an offload tier (kv_cache/offload_tier.py) below it, every block listed is also saved there once, and a key
the pool lacks but the tier holds is a *pending restore*: `lookup` returns a negative handle for it, which
`restore` turns into a fresh block the tier's copy is loaded into. Saves, loads and the block manager's copies go
into one ordered queue (`transfers`), which the runner carries out in order before the step's forward.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Sequence

from llmpipe.kv_cache.offload_tier import LoadBlock, SaveBlock

if TYPE_CHECKING:
    from llmpipe.kv_cache.offload_tier import OffloadTier, TierEntry

CacheKey = Hashable


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    listed: dict[CacheKey, tuple[int, ...]] = field(default_factory=dict)  # keys it is cached under → their tokens


class NoFreeBlocksError(RuntimeError):
    pass


def block_hash(parent: int | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """A token block's 128-bit digest, chained from its parent's (a first block's from the request's cache
    salt: its LoRA adapter, or vLLM's `cache_salt`). Stable across processes, unlike Python's hash: the disk
    tier's keys outlive the process that wrote them."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"p" + parent.to_bytes(16, "little") if parent is not None else b"s" + (salt or "").encode())
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


class BlockPool:
    def __init__(self, num_blocks: int, first_id: int = 0, tier: OffloadTier | None = None, transfers: list | None = None):
        """Blocks first_id ... first_id + num_blocks - 1 (a second pool's ids follow the first's).
        tier: the offload tier below this pool; transfers: the queue its saves and loads go into."""
        self.first_id = first_id
        self.blocks = [Block(first_id + i) for i in range(num_blocks)]
        # Blocks with ref_count 0, oldest-freed first; an OrderedDict gives O(1) removal on a cache hit.
        self.free: OrderedDict[int, None] = OrderedDict((first_id + i, None) for i in range(num_blocks))
        self.cached: dict[CacheKey, int] = {}
        self.peak_blocks_in_use = 0
        self.tier = tier
        self.transfers = [] if transfers is None else transfers
        self.pending: list[TierEntry] = []  # the tier entries behind the handles lookup gave since forget_pending

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

    def list_block(self, block_id: int, key: CacheKey, tokens: tuple[int, ...], offload: bool = True) -> None:
        """Index a block for reuse under key (the first block listed under a key keeps it), and save it to the
        tier (`offload`: its contents are final, not a block still filling)."""
        if key not in self.cached:
            self.cached[key] = block_id
            self.blocks[block_id - self.first_id].listed[key] = tokens
            if offload and self.tier is not None and key not in self.tier:
                self.transfers.append(SaveBlock(block_id, key, tokens))

    def lookup(self, key: CacheKey, tokens: tuple[int, ...]) -> int | None:
        """The block listed under key with these tokens; else, where the tier holds them, a pending restore's
        handle (negative: `restore` makes it a block); else None."""
        block_id = self.cached.get(key)
        if block_id is not None and self.blocks[block_id - self.first_id].listed[key] == tokens:
            return block_id
        entry = self.tier.find(key, tokens) if self.tier is not None else None
        if entry is None:
            return None
        self.pending.append(entry)
        return -len(self.pending)

    def forget_pending(self) -> None:
        """Handles from earlier lookups are void (a new prefix lookup starts)."""
        self.pending.clear()
        if self.tier is not None:
            self.tier.end_lookup()

    def restore(self, handle: int) -> int:
        """A fresh block holding a pending restore's entry (loaded before the next forward), listed under its key."""
        entry = self.pending[-handle - 1]
        block_id = self.take()
        self.tier.stats.restored += 1
        self.list_block(block_id, entry.key, entry.tokens, offload=False)
        self.transfers.append(LoadBlock(entry, block_id))
        return block_id
