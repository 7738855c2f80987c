"""Scheduler: continuous batching under a token budget, with chunked prefill and preemption.

Each step: every running sequence that is decoding gets one token (decodes first, so streams
never stall behind a long prompt); the remaining token budget goes to prefill chunks, first of
sequences already admitted, then of waiting ones, in arrival order. Blocks are reserved for just
the tokens scheduled, after the sequence's window groups drop the blocks they no longer reach.
When the cache runs out of blocks, the most recently admitted sequence is preempted: its blocks
are freed and it goes back to the front of the queue, keeping the tokens it generated (they are
recomputed on resumption, from the prefix cache where it still holds them).

The scheduler is the only writer of a sequence's progress (`num_computed_tokens`): after the
runner computed a batch, `update_from_output` counts what it computed, registers the newly full
blocks in the prefix cache and frees what the windows no longer reach; `add_drafts` decides
which speculative tokens get slots, `accept_drafts` keeps the accepted ones; `fork` starts the
other samples of an n > 1 request from sample 0's blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from llmpipe.engine.block_manager import BlockManager
from llmpipe.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # new tokens computed this step, starting at seq.num_computed_tokens

    @property
    def completes_prefill(self) -> bool:
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    decodes: list[Sequence]
    prefills: list[ScheduledChunk]
    # Speculative tokens a decode also feeds this step (verified together with its newest token).
    draft_token_ids: dict[Sequence, list[int]] = field(default_factory=dict)
    # Block copies (source, destination) the runner makes before the forward: a prefix hit ending
    # inside a block, a forked sample's partial last block.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Waiting sequences passed over because they were not ready (their grammars still compiling).
    num_held: int = 0

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 is_ready: Callable[[Sequence], bool] = lambda seq: True):
        """`is_ready`: whether a waiting sequence may start (False: its grammar still compiles)."""
        self.blocks = block_manager
        self.is_ready = is_ready
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_budget: Callable[[int, int], int | None] | None = None) -> SchedulerOutput:
        """`prefill_budget(num_decodes, num_sequences)`: at most this many prefill tokens (None: no cap)
        in a step with num_decodes decodes while num_sequences run or wait (up to max_num_seqs)."""
        out = SchedulerOutput([], [])
        budget = self.max_num_batched_tokens
        for seq in list(self.running):  # decodes first: one token each
            if seq.status is SequenceStatus.RUNNING and not seq.in_prefill and self._reserve_slots(seq, 1, out):
                out.decodes.append(seq)
                budget -= 1
        if out.decodes and prefill_budget is not None:
            cap = prefill_budget(len(out.decodes), min(len(self.running) + len(self.waiting), self.max_num_seqs))
            budget = budget if cap is None else min(budget, cap)
        for seq in list(self.running):  # then prefill chunks of admitted sequences
            if budget > 0 and seq.status is SequenceStatus.RUNNING and seq.in_prefill:
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if self._reserve_slots(seq, n, out):
                    out.prefills.append(ScheduledChunk(seq, n))
                    budget -= n
        held: list[Sequence] = []  # not ready yet: they keep their place in the queue
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.is_ready(seq):
                held.append(self.waiting.popleft())
                continue
            # vLLM's rule: a prompt whose logprobs are still wanted is computed, never served from the cache.
            hit = self.blocks.no_hit() if seq.needs_prompt_logprobs else self.blocks.prefix_hit(seq)
            n = min(seq.num_tokens - hit.num_tokens, budget)
            if not self.blocks.can_allocate(seq, hit, n):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, hit, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefills.append(ScheduledChunk(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(held))
        out.num_held = len(held)
        out.block_copies = self.blocks.take_block_copies()
        return out

    def add_drafts(self, out: SchedulerOutput, drafts: dict[Sequence, list[int]]) -> dict[Sequence, list[int]]:
        """Give the decodes' draft tokens slots where the cache has blocks for them; the drafts kept."""
        kept = {}
        for seq, token_ids in drafts.items():
            if self.blocks.can_reserve(seq, 1 + len(token_ids)):
                self.blocks.reserve(seq, 1 + len(token_ids))
                out.draft_token_ids[seq] = kept[seq] = token_ids
        return kept

    def update_from_output(self, out: SchedulerOutput) -> None:
        """The batch was computed: its tokens' K/V are in the cache."""
        for seq in out.decodes:
            seq.num_computed_tokens += 1
        for item in out.prefills:
            item.seq.num_computed_tokens += item.num_tokens
        for seq in out.decodes + [item.seq for item in out.prefills]:
            self.blocks.register_full_blocks(seq, seq.num_computed_tokens)
            self.blocks.free_unreachable(seq)  # at once, so usage and stats show what is held

    def forget_computed(self, seqs: list[Sequence]) -> None:
        """Recompute mode (no KV cache kept): these sampled sequences compute everything next step."""
        for seq in seqs:
            seq.num_computed_tokens = 0

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """The accepted drafts' K/V stay (the newest token's was counted already); the rejected
        tail's blocks go back."""
        seq.num_computed_tokens += num_accepted
        self.blocks.register_full_blocks(seq, seq.num_computed_tokens)
        self.blocks.trim(seq, seq.num_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Start child from parent's blocks (full ones shared, the partial last one copied with the next
        step) and run it from now on. False if no block is free to copy into: the child then queues to
        prefill (from the prefix cache)."""
        if not self.blocks.can_fork(parent):
            self.add(child)
            return False
        self.blocks.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        return True

    def _reserve_slots(self, seq: Sequence, num_new_tokens: int, out: SchedulerOutput) -> bool:
        """Give seq blocks for its next num_new_tokens tokens (after freeing what its windows no
        longer reach), preempting the newest sequences until they fit. False if seq itself had to go."""
        self.blocks.free_unreachable(seq)
        while not self.blocks.can_reserve(seq, num_new_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim in out.decodes:
                out.decodes.remove(victim)
            out.prefills = [item for item in out.prefills if item.seq is not victim]
            if victim is seq:
                return False
        self.blocks.reserve(seq, num_new_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop its KV, requeue it first, keep its generated tokens."""
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
