"""StepCosts: what a step of n rows takes, as measured, and so how many prefill tokens a step may carry.

A step that carries prefill chunks beside running decodes makes every stream wait for them: a
128-token prompt can cost three decode steps. With `EngineConfig.max_decode_stall` the core keeps
such a step to about that many times a decode-only step, capping the prefill tokens it schedules
beside decodes from these running estimates (the rest of the prompt follows in later steps).

Two choices make the cap hold under load. The reference is the decode step that the running and
waiting sequences would make together, not the decodes of the moment: measured against those
alone the cap shrinks as prompts queue, and under a load whose prompts outweigh its answers fewer
and fewer sequences decode while the queue grows (32 streams of 128-token prompts and 64-token
answers: 12 decoded a step and TTFT reached 22 s). And a step's cost is kept by its number of rows
(tokens), decode or prefill alike: past a few rows every row costs about the same compute, while
one running mean of "a decode step" and of "a prefill token" mixed steps of every size together.

And when more sequences wait than decode (a burst of new requests beside a stream or two), a step
may stall the few decoding streams for the many waiting ones: with d of n sequences decoding, up to
max_stall x (n - d) / d times the reference. 16 prompts arriving at once used to reach their first
token one a step, over 4.5 s, the last ones behind every earlier one's decodes. While most of the
sequences decode the cap is as before: a larger one there bunches the prompts into rare long steps,
and the streams' ITL p99 runs to 4-5x their p50 (measured at 16 and 32 streams).

That burst allowance stops at max_stall x a decode step of a full batch (max_num_seqs), whatever
waits: the reference already grows with the queue, so the allowance grew as its square, and one
completions request listing 256 short prompts (~3,000 tokens) put 127 of them, 1,524 tokens, into
one step beside a lone stream (its token 1.8 s late; 4.6 s on one thread). A step that size already
runs at the per-row cost, so a larger one admits a burst no sooner; it only stalls the streams.

Pooling requests (embeddings, scores) come after a step's generation work, with a budget of their
own (`pooling_budget`): what keeps the step within POOLING_STALL of that work alone, measured on steps
of its kind (beside decodes alone they are decode rows, and a step of decode rows costs far less than a
step that leaves the decode path: `decode_steps`).
"""

from __future__ import annotations

import bisect

SMOOTHING = 0.2  # weight of the newest step in the running means
MIN_PREFILL_CHUNK = 16  # never fewer prefill tokens than this beside decodes: prompts must progress
# Pooling requests beside decodes keep a step within this many times the decodes alone: a burst of
# embeddings (a RAG pipeline indexing) must leave a chat stream's pace as it was (issue 47: its ITL
# p99 up by 1.5x at most). They end with their prompts, so no reply waits on them the way a stream
# waits on its own first token, and they get no burst allowance.
POOLING_STALL = 1.1


class CostTable:
    """Running means of a step's time by its rows."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def observe(self, num_rows: int, seconds: float) -> None:
        if num_rows:
            self.seconds[num_rows] = _mean(self.seconds.get(num_rows), seconds)

    def cost(self, num_rows: int) -> float | None:
        """A step of num_rows rows: measured, else interpolated between the nearest measured sizes
        (in proportion to the rows beyond them); None before any step was measured."""
        if num_rows in self.seconds or not self.seconds:
            return self.seconds.get(num_rows)
        sizes = sorted(self.seconds)
        i = bisect.bisect(sizes, num_rows)
        if 0 < i < len(sizes):
            lo, hi = sizes[i - 1], sizes[i]
            return self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (num_rows - lo) / (hi - lo)
        nearest = sizes[min(i, len(sizes) - 1)]
        return self.seconds[nearest] * num_rows / nearest

    def rows_within(self, seconds: float) -> int:
        """The most rows a step can have and still take at most `seconds`, as far as measured."""
        sizes = sorted(self.seconds)
        for lo, hi in zip([0, *sizes], sizes):
            t_lo, t_hi = self.seconds.get(lo, 0.0), self.seconds[hi]
            if t_hi > seconds:
                return lo if t_hi <= t_lo else int(lo + (hi - lo) * (seconds - t_lo) / (t_hi - t_lo))
        return int(sizes[-1] * seconds / self.seconds[sizes[-1]])


class StepCosts(CostTable):
    """Every step's cost by its rows, and apart, the steps of decode rows alone (what the decode path
    costs: pooling prompts beside streams are fed as decode rows)."""

    def __init__(self, max_stall: float | None, max_num_seqs: int) -> None:
        super().__init__()
        self.max_stall = max_stall
        self.max_num_seqs = max_num_seqs
        self.decode_steps = CostTable()

    def observe(self, num_rows: int, seconds: float, decode_only: bool = False) -> None:
        super().observe(num_rows, seconds)
        if decode_only:
            self.decode_steps.observe(num_rows, seconds)

    def pooling_budget(self, rows: int, decode_only: bool) -> int | None:
        """Tokens of pooling requests (embeddings, scores) a step may carry beside `rows` rows of generation
        work: up to POOLING_STALL times that work alone, as steps of its kind measured (decode rows alone:
        pooling prompts then join as decode rows, where the model allows), growing a row at a time past the
        largest seen while it fits; no burst allowance and no MIN_PREFILL_CHUNK, one token a step at least
        (where more rows cost much the embeddings wait for the streams, not the other way round); None: no
        cap (off)."""
        if self.max_stall is None:
            return None
        steps = self.decode_steps if decode_only else self
        reference = steps.cost(rows)
        if reference is None:
            return 0
        allowed = min(self.max_stall, POOLING_STALL) * reference
        more = steps.rows_within(allowed)
        largest = max(steps.seconds)
        if steps.seconds[largest] <= allowed:  # one row past the largest step seen while it stays within
            more = max(more, largest + 1)
        return max(1, more - rows)

    def prefill_budget(self, num_decodes: int, num_sequences: int) -> int | None:
        """Prefill tokens a step with num_decodes decodes may carry so that it takes at most
        max_stall times a decode-only step of num_sequences (the running and waiting ones, up to
        the batch limit), or max_stall x (num_sequences - num_decodes) / num_decodes times it where
        that is more, up to max_stall times a decode step of max_num_seqs; None: no cap (off, or
        nothing decodes); 0 while no step has been measured (this one will be)."""
        if self.max_stall is None or not num_decodes:
            return None
        num_sequences = max(num_sequences, num_decodes)
        reference = self.cost(num_sequences)
        if reference is None:
            return 0
        burst = reference * (num_sequences - num_decodes) / num_decodes
        allowed = self.max_stall * max(reference, min(burst, self.cost(self.max_num_seqs)))
        return max(MIN_PREFILL_CHUNK, self.rows_within(allowed) - num_decodes)


def _mean(current: float | None, value: float) -> float:
    return value if current is None else (1 - SMOOTHING) * current + SMOOTHING * value
