"""The recurrent state (Gated DeltaNet / Mamba-style linear attention): per sequence and layer a fixed-size conv
state and SSM state, whatever the sequence's length — vLLM's MambaSpec, llama.cpp's llama-memory-recurrent.

States live in a pool of their own (`slots` of them, sized when the KV budget is split: engine/kv_pool.py), beside
the token blocks of the attention layers; a state's id follows the token blocks' ids, so block copies name either.
A sequence's table holds its live state (ids[0]), updated in place by every step, and, for the step that crosses a
block boundary, a second slot the layers copy the state at that boundary into (`snapshot_at`): after the step it is
listed in the prefix cache under the hash of the token block it ends with and let go, so a later request sharing
that prefix — the next turn of a chat, a preempted sequence coming back — starts from a copy of it instead of from
token 0. A state cannot be rolled back: speculative decoding is refused for these models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Sequence

import torch

from llmpipe.kv_cache.block_pool import BlockPool
from llmpipe.kv_cache.kinds.base import BlockTable, GroupBatch, GroupManager, KVCacheSpec


@dataclass
class StateTable(BlockTable):
    """A sequence's states: ids[0] the live one; ids[1], while a step runs, the copy of the state at `snapshot_at`
    tokens (-1: none)."""

    snapshot_at: int = -1


@dataclass
class StateChunk:
    """A prefill chunk as the recurrent layers see it."""

    rows: tuple[int, int]  # [first, last) rows of the step's tokens
    slot: int  # its live state's index in the layer's state tensors
    fresh: bool  # the chunk starts the sequence: the state starts from zeros (the slot holds a stale one)
    snapshot: tuple[int, int] | None = None  # (tokens into the chunk, slot): copy the state after them there


@dataclass
class RecurrentMetadata:
    """What the recurrent layers of a step read: decode rows first (one token each), then the prefill chunks.
    Slots are indices into the layers' state tensors (ids less the pool's first id)."""

    decode_slots: torch.Tensor  # [decode rows] long
    decode_snapshots: list[tuple[int, int]] = field(default_factory=list)  # (slot, copy-to slot) after the step
    chunks: list[StateChunk] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_slots)


@dataclass
class RecurrentState:
    """One layer's states in the pool: conv [slots, channels, kernel - 1] and ssm [slots, heads, k_dim, v_dim]."""

    conv: torch.Tensor
    ssm: torch.Tensor

    def copy(self, src: int, dst: int) -> None:
        self.conv[dst] = self.conv[src]
        self.ssm[dst] = self.ssm[src]


@dataclass(frozen=True)
class RecurrentStateSpec(KVCacheSpec):
    """Per layer: a conv state of `conv_shape` and an SSM state of `ssm_shape`, float32. `slots`: states in the pool
    (0 until the KV budget is split); `first_id`: the id of slot 0 (the token blocks' count)."""

    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    slots: int = 0
    first_id: int = 0
    window = None
    per_sequence = True  # a fixed amount per sequence, from a pool of its own

    @property
    def name(self) -> str:
        return "recurrent"

    @property
    def grows(self) -> bool:
        return False

    @property
    def layer_bytes(self) -> int:
        """One layer's state (conv and SSM, float32)."""
        return 4 * (math.prod(self.conv_shape) + math.prod(self.ssm_shape))

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        return 0  # no token blocks: one state from the state pool

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        return 0

    def manager(self, pool: BlockPool, group: int, block_size: int) -> GroupManager:
        return RecurrentStateManager(self, BlockPool(self.slots, self.first_id), group, block_size)

    def metadata(self, batch: GroupBatch, block_size: int, device: torch.device) -> RecurrentMetadata:
        first = self.first_id
        tables: list[StateTable] = batch.tables  # type: ignore[assignment]
        snapshots = [(t.ids[0] - first, t.ids[1] - first) for t, n in zip(tables, batch.lens) if t.snapshot_at == n]
        chunks = []
        for table, start, end, row in batch.chunks:
            snap = table.snapshot_at  # type: ignore[attr-defined]
            snapshot = (snap - start, table.ids[1] - first) if start < snap <= end else None
            chunks.append(StateChunk((row, row + end - start), table.ids[0] - first, start == 0, snapshot))
        slots = torch.tensor([t.ids[0] - first for t in tables], dtype=torch.long, device=device)
        return RecurrentMetadata(slots, snapshots, chunks)


class RecurrentStateManager(GroupManager):
    """A sequence holds one live state from its first token to its end; checkpoints at block boundaries are copies
    listed in the prefix cache (module docstring)."""

    def empty_table(self) -> StateTable:
        return StateTable()

    def missing(self, table: BlockTable, start: int, end: int) -> int:
        return 0 if table.ids else 1  # a checkpoint's slot is taken only where one is free (reserve)

    def reserve(self, table: BlockTable, start: int, end: int) -> None:
        assert isinstance(table, StateTable)
        if not table.ids:
            table.ids.append(self.pool.take())
        self._drop_snapshot(table)
        boundary = end - end % self.block_size
        if self.prefix_caching and start < boundary and self.pool.num_free_blocks:
            table.ids.append(self.pool.take())
            table.snapshot_at = boundary

    def release_unreachable(self, table: BlockTable, num_computed_tokens: int) -> None:
        """A checkpoint the step took but nothing listed (its block was hashed before) goes back."""
        assert isinstance(table, StateTable)
        if 0 <= table.snapshot_at <= num_computed_tokens:
            self._drop_snapshot(table)

    def _drop_snapshot(self, table: StateTable) -> None:
        if len(table.ids) > 1:
            self.pool.release(table.ids[1:])
            del table.ids[1:]
        table.snapshot_at = -1

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Nothing to give back: the state is one slot whatever the length (and cannot be rolled back)."""

    def fork_cost(self, table: BlockTable, num_tokens: int) -> int:
        return 1

    def fork(self, table: BlockTable, num_tokens: int) -> tuple[BlockTable, tuple[int, int] | None]:
        """The child's own live state, a copy of the parent's (queued with the step's copies)."""
        mine = StateTable(0, [self.pool.take()])
        return mine, (table.ids[0], mine.ids[0])

    def copy_target(self, table: BlockTable, num_hashed_blocks: int) -> int:
        return table.ids[0]

    # ---- the prefix cache: checkpoints ---------------------------------------------------------

    def highest_miss(self, hashes: list[int], tokens: Sequence[int], k: int) -> int | None:
        """The longest prefix of at most k token blocks whose end has a checkpoint (0: none)."""
        if k == 0 or self.lookup(k - 1, hashes, tokens) is not None:
            return None
        return next((j for j in range(k - 1, 0, -1) if self.lookup(j - 1, hashes, tokens) is not None), 0)

    def hit(self, hashes: list[int], tokens: Sequence[int], k: int) -> tuple[BlockTable, int | None]:
        return StateTable(), (self.lookup(k - 1, hashes, tokens) if k else None)

    def register(self, table: BlockTable, index: int, key_hash: int, chunk: tuple[int, ...]) -> None:
        assert isinstance(table, StateTable)
        if table.snapshot_at == (index + 1) * self.block_size and len(table.ids) > 1:
            self.pool.list_block(table.ids[1], (self.group, key_hash), chunk)
            self._drop_snapshot(table)
