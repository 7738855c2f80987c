"""Scheduler: continuous batching under a token budget, with chunked prefill and preemption.

Each step: every running sequence that is decoding gets one token (decodes first, so streams
never stall behind a long prompt); the remaining token budget goes to prefill chunks, first of
sequences already admitted, then of waiting ones, in arrival order. Blocks are reserved for just
the tokens scheduled, after the sequence's window groups drop the blocks they no longer reach.
When the cache runs out of blocks, the most recently admitted sequence is preempted: its blocks
are freed and it goes back to the front of the queue, keeping the tokens it generated (they are
recomputed on resumption, from the prefix cache where it still holds them).

The scheduler is the only writer of a sequence's progress: after the executor computed and
sampled a batch, `update_from_output(batch, model_output)` counts what it computed, registers the
newly full blocks in the prefix cache, frees what the windows no longer reach, starts the other
samples of an n > 1 request from sample 0's blocks, appends each sample's tokens under the stop
rules, ends the pooling requests whose prompts completed with their results, keeps the accepted
drafts and frees what finished. `add_drafts` decides which speculative tokens get slots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from llmpipe.engine.block_manager import BlockTransfer, BlockManager
from llmpipe.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from llmpipe.engine.model_output import ModelOutput
    from llmpipe.engine.stop_rules import StopRules
    from llmpipe.spec import Proposal


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
    proposals: dict[Sequence, Proposal] = field(default_factory=dict)  # those drafts as proposed
    # Sample 0 of an n > 1 request whose prompt completes this step → the other samples, which draw
    # their first token from its row and then run from its blocks.
    forks: dict[Sequence, list[Sequence]] = field(default_factory=dict)
    # Block copies (source, destination) the runner makes before the forward: a prefix hit ending
    # inside a block, a forked sample's partial last block.
    block_copies: list[BlockTransfer] = field(default_factory=list)  # copies and offload-tier transfers, in order
    # Waiting sequences passed over because they were not ready (their grammars still compiling).
    num_held: int = 0
    # Pooling requests' prompt tokens fed as decode rows beside running decodes (a token each, from
    # seq.num_computed_tokens): the step keeps the decode path, so the streams keep their pace.
    pooling_rows: dict[Sequence, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.pooling_rows

    @property
    def num_rows(self) -> int:
        """Tokens the step computes (drafts aside): what its cost is kept by (StepCosts)."""
        return len(self.decodes) + sum(item.num_tokens for item in self.prefills) + sum(self.pooling_rows.values())

    def pooling_chunks(self) -> list[ScheduledChunk]:
        """What the pooling requests compute this step, in the runner's row order: their decode rows, then
        their prefill chunks."""
        return ([ScheduledChunk(seq, n) for seq, n in self.pooling_rows.items()]
                + [item for item in self.prefills if item.seq.pooling is not None])


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 is_ready: Callable[[Sequence], bool] = lambda seq: True, stop_rules: StopRules | None = None,
                 keep_kv: bool = True, pool_every_token: bool = False, pool_as_rows: bool = False):
        """`is_ready`: whether a waiting sequence may start (False: its grammar still compiles);
        `stop_rules`: how sampled tokens are appended; `keep_kv` False: recompute every step;
        `pool_every_token`: pooling requests read every prompt position (mean / cls pooling), so the
        prefix cache serves them none; `pool_as_rows`: beside running decodes, pooling prompts advance as
        decode rows (a model whose layers keep no per-sequence state)."""
        self.blocks = block_manager
        self.is_ready = is_ready
        self.stop_rules = stop_rules
        self.keep_kv = keep_kv
        self.pool_every_token = pool_every_token
        self.pool_as_rows = pool_as_rows
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.release_hooks: list[Callable[[Sequence], None]] = []  # what else a finished sequence frees
        self.pooling: set[Sequence] = set()  # pooling requests in flight: a step looks for them only when some are
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt tokens computed (prefix-cache hits excluded)
        self.num_generation_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if seq.pooling is not None:
            self.pooling.add(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_budget: Callable[[int, int], int | None] | None = None,
                 pooling_budget: Callable[[int, bool], int | None] | None = None) -> SchedulerOutput:
        """`prefill_budget(num_decodes, num_sequences)`: at most this many prefill tokens (None: no cap)
        in a step with num_decodes decodes while num_sequences run or wait (up to max_num_seqs);
        `pooling_budget(rows, decode_only)`: at most this many tokens of pooling requests beside a step's
        generation work of `rows` rows (decode rows alone, or with prompt chunks)."""
        out = SchedulerOutput([], [])
        budget = self.max_num_batched_tokens
        for seq in list(self.running):  # decodes first: one token each
            if seq.status is SequenceStatus.RUNNING and not seq.in_prefill and self._reserve_slots(seq, 1, out):
                out.decodes.append(seq)
                budget -= 1
        if out.decodes and prefill_budget is not None:
            cap = prefill_budget(len(out.decodes), min(len(self.running) + len(self.waiting), self.max_num_seqs))
            budget = budget if cap is None else min(budget, cap)
        budget = self._prefill(out, budget, pooling=False)  # then generation prompts: admitted, then waiting
        # Pooling requests last: they add a bounded share to the generation work (all of what is left when
        # there is none), as decode rows beside decodes alone where the model allows.
        if self.pooling:
            generation = out.num_rows
            cap = pooling_budget(generation, not out.prefills) if generation and pooling_budget is not None else None
            as_rows = cap is not None and not out.prefills and self.pool_as_rows
            self._prefill(out, budget if cap is None else min(budget, cap), pooling=True, as_rows=as_rows)
        out.block_copies = self.blocks.take_block_copies()
        out.forks = {item.seq: item.seq.siblings for item in out.prefills if item.completes_prefill and item.seq.siblings}
        return out

    def _prefill(self, out: SchedulerOutput, budget: int, pooling: bool, as_rows: bool = False) -> int:
        """Chunks of the admitted sequences still in prefill, then of the waiting ones in arrival order: of
        pooling requests or of the others. Returns the budget left."""
        for seq in list(self.running):
            if budget > 0 and (seq.pooling is not None) == pooling and seq.status is SequenceStatus.RUNNING \
                    and seq.in_prefill:
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if self._reserve_slots(seq, n, out):
                    self._add_chunk(out, seq, n, as_rows)
                    budget -= n
        passed: list[Sequence] = []  # the other kind, or not ready: they keep their place in the queue
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (seq.pooling is not None) != pooling or not self.is_ready(seq):
                out.num_held += (seq.pooling is not None) == pooling
                passed.append(self.waiting.popleft())
                continue
            # vLLM's rule: a prompt whose logprobs are still wanted is computed, never served from the cache.
            computed = seq.needs_prompt_logprobs or (seq.pooling is not None and self.pool_every_token)
            hit = self.blocks.no_hit() if computed else self.blocks.prefix_hit(seq)
            n = min(seq.num_tokens - hit.num_tokens, budget)
            if not self.blocks.can_allocate(seq, hit, n):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, hit, n)
            seq.num_computed_tokens = hit.num_tokens  # the prefix cache's blocks hold them
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_chunk(out, seq, n, as_rows)
            budget -= n
        self.waiting.extendleft(reversed(passed))
        return budget

    @staticmethod
    def _add_chunk(out: SchedulerOutput, seq: Sequence, n: int, as_rows: bool) -> None:
        if as_rows and seq.pooling is not None:
            out.pooling_rows[seq] = n
        else:
            out.prefills.append(ScheduledChunk(seq, n))

    def add_drafts(self, out: SchedulerOutput, drafts: dict[Sequence, list[int]]) -> dict[Sequence, list[int]]:
        """Give the decodes' draft tokens slots where the cache has blocks for them; the drafts kept."""
        kept = {}
        for seq, token_ids in drafts.items():
            if self.blocks.can_reserve(seq, 1 + len(token_ids)):
                self.blocks.reserve(seq, 1 + len(token_ids))
                out.draft_token_ids[seq] = kept[seq] = token_ids
        return kept

    def update_from_output(self, out: SchedulerOutput, model_output: ModelOutput) -> list[Sequence]:
        """The batch was computed and sampled: apply it. Returns the sequences it advanced, in order."""
        self._count_computed(out)
        failed = self._fail_requests(model_output.failed_requests, out)
        for seq, logprobs in model_output.prompt_logprobs.items():
            if not seq.finished:
                seq.add_prompt_logprobs(logprobs)
        self._fork(out, model_output)
        for seq, result in model_output.pooled.items():  # a pooling request ends with its prompt
            if not seq.finished:
                seq.pooled = result
                seq.finish("stop")
        sampled = list(dict.fromkeys([*model_output.sampled, *model_output.failed, *model_output.pooled]))
        for seq in sampled:
            if seq in model_output.failed:
                seq.fail(model_output.failed[seq])
            elif seq in model_output.sampled:
                tokens = model_output.sampled[seq]
                self.num_generation_tokens += self.stop_rules.emit(seq, tokens)
                if seq in out.proposals and not seq.finished:
                    self.accept_drafts(seq, len(tokens.token_ids) - 1)
            if seq.finished:
                self.release(seq)
        if not self.keep_kv:
            self.forget_computed(sampled)
        return list(dict.fromkeys(sampled + [item.seq for item in out.prefills] + failed))

    def _count_computed(self, out: SchedulerOutput) -> None:
        """The batch's tokens' K/V are in the cache."""
        for seq in out.decodes:
            seq.num_computed_tokens += 1
        for item in out.prefills:
            item.seq.num_computed_tokens += item.num_tokens
        for seq, n in out.pooling_rows.items():
            seq.num_computed_tokens += n
        self.num_prefill_tokens += sum(item.num_tokens for item in out.prefills) + sum(out.pooling_rows.values())
        for seq in out.decodes + [item.seq for item in out.prefills] + list(out.pooling_rows):
            self.blocks.register_full_blocks(seq, seq.num_computed_tokens)
            self.blocks.free_unreachable(seq)  # at once, so usage and stats show what is held

    def _fail_requests(self, errors: dict[str, str], out: SchedulerOutput) -> list[Sequence]:
        """A request whose prompt logprobs failed fails whole: sample 0 and the samples that would start
        from its blocks. Returns the samples failed."""
        failed = []
        for item in out.prefills:
            if item.seq.request_id in errors:
                for seq in (item.seq, *item.seq.siblings):
                    if not seq.finished:
                        seq.fail(errors[seq.request_id])
                        self.release(seq)
                        failed.append(seq)
        return failed

    def _fork(self, out: SchedulerOutput, model_output: ModelOutput) -> None:
        """Sample 0 has prefilled the shared prompt: the other samples run from its blocks now, or, where
        no block is free to copy into, queue to prefill on their own (their draw is then not used)."""
        for parent, siblings in out.forks.items():
            parent.siblings = []
            for sibling in siblings:
                if not sibling.finished and not self.fork(parent, sibling):
                    model_output.sampled.pop(sibling, None)
                    model_output.failed.pop(sibling, None)

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
            out.pooling_rows.pop(victim, None)
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

    def release(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's blocks (and what the hooks hold for it) at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
        self.pooling.discard(seq)
        for hook in self.release_hooks:
            hook(seq)
