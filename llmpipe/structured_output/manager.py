"""StructuredOutputManager: the engine core's side of structured outputs (vLLM v1's shape).

Each request's constraint compiles on a small thread pool, cached by what it is, so the step never
waits for it (the pool's threads run at a low priority, so a long compile yields the cores to the
step, and on large stacks under llguidance's limits, as the front end's sandbox checked it): the
scheduler holds the request back until its grammar is ready (`is_ready`). Every
constrained sample gets its own matcher, a copy of the compiled one; `fill_bitmasks` fills the
allowed-token bitmasks of a whole batch in one llguidance call (its threads, the GIL released),
`advance` moves a sample's matcher on by each token it emits, and `fill_bitmasks_through_drafts`
gives speculative decoding the masks after each draft token, rolling the matcher back after.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import llguidance
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par
import numpy as np

from llmpipe.errors import InvalidRequestError
from llmpipe.sampling_params import SamplingParams
from llmpipe.structured_output.grammar import (
    CHECK_STACK_BYTES, COMPILE_NICE, GrammarKey, grammar_key, grammar_text, parser_limits,
)
from llmpipe.structured_output.vocabulary import grammar_vocabulary
from llmpipe.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llmpipe.engine.sequence import Sequence

CACHE_SIZE = 256  # compiled grammars kept (tool-call schemas repeat across requests)
COMPILE_THREADS = 2
COMPILE_STACK_BYTES = 2 * CHECK_STACK_BYTES  # a margin over the stack the front end's check ran on


GRAMMAR_END = "grammar_end"  # stop_reason of an output its grammar ended before min_tokens


class GrammarError(Exception):
    """A sample's constraint failed: its grammar did not compile."""


class GrammarExhausted(GrammarError):
    """A token the grammar allowed ran its parser out of llguidance's limits: no token can follow."""


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._vocabulary_lock = threading.Lock()
        self._pool: CompilePool | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[GrammarKey, Future[llguidance.LLMatcher]] = OrderedDict()
        self._requests: dict[str, Future[llguidance.LLMatcher]] = {}  # request id → its compiled grammar
        self._matchers: dict[Sequence, llguidance.LLMatcher] = {}  # sequence → its own matcher

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, params: SamplingParams) -> None:
        """Start compiling the request's constraint (a cache hit is ready at once)."""
        if params.structured_outputs is None:
            return
        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this model has none",
                                      param="structured_outputs")
        self._requests[request_id] = self._compile(grammar_key(params.structured_outputs))

    def forget_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    @property
    def active(self) -> bool:
        """Whether any request in the engine has a constraint."""
        return bool(self._requests)

    def is_ready(self, seq: Sequence) -> bool:
        """Whether seq may be scheduled: unconstrained, or its grammar compiled (or failed to)."""
        future = self._requests.get(seq.request_id)
        return future is None or future.done()

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block until a pending compile finishes (or the timeout): for a step with nothing else to run."""
        pending = [f for f in self._requests.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def prepare(self, seq: Sequence) -> str | None:
        """Give a constrained seq its own matcher (a copy of the compiled one) on first use; the
        error message if its grammar failed to compile."""
        if seq in self._matchers or seq.request_id not in self._requests:
            return None
        try:
            template = self._requests[seq.request_id].result()
        except Exception as err:  # the front end checked it: only a core without that check gets here
            return f"structured_outputs: the grammar did not compile: {err}"
        matcher = self._matchers[seq] = template.deep_copy()
        for token in seq.output_token_ids:  # tokens it holds already (a sample starts with none)
            matcher.consume_token(token)
        return None

    def release(self, seq: Sequence) -> None:
        self._matchers.pop(seq, None)

    # ---- per step ---------------------------------------------------------------------------

    def fill_bitmasks(self, seqs: list[Sequence]) -> list[np.ndarray | None]:
        """The bitmask (int32 words, bit i of the row: token i allowed) of each constrained seq's
        next token, every row filled in one parallel call; None for an unconstrained seq."""
        masks: list[np.ndarray | None] = [None] * len(seqs)
        if not self._matchers:  # the common case: nothing constrained
            return masks
        rows = [i for i, seq in enumerate(seqs) if seq in self._matchers]
        if not rows:
            return masks
        bitmask = np.zeros((len(rows), self.words), dtype=np.int32)
        fill_next_token_bitmask_par(self._executor_for(), [(self._matchers[seqs[i]], j) for j, i in enumerate(rows)],
                                    bitmask)
        for j, i in enumerate(rows):
            masks[i] = bitmask[j]
        return masks

    def fill_bitmasks_through_drafts(self, seq: Sequence, drafts: list[int]) -> list[np.ndarray | None]:
        """Bitmasks of seq's next token and after each draft token in turn (len(drafts) + 1 rows),
        the matcher advanced through the drafts then rolled back. Past a draft the grammar rejects,
        the rows repeat the last mask: those positions are never reached (that draft is rejected)."""
        matcher = self._matchers.get(seq)
        if matcher is None:
            return [None] * (len(drafts) + 1)
        bitmask = np.zeros((len(drafts) + 1, self.words), dtype=np.int32)
        consumed = 0
        for row in range(len(drafts) + 1):
            if row > consumed:  # the previous draft was rejected
                bitmask[row] = bitmask[row - 1]
                continue
            fill_next_token_bitmask(matcher, bitmask, row)
            if row < len(drafts) and not matcher.is_stopped() and matcher.try_consume_tokens([drafts[row]]) == 1:
                consumed += 1
        if consumed:
            matcher.rollback(consumed)
        return list(bitmask)

    def advance(self, seq: Sequence, token: int) -> None:
        """Move seq's matcher past the token it emitted (one its bitmask allowed); GrammarExhausted if
        the parser cannot take it within its limits."""
        matcher = self._matchers.get(seq)
        if matcher is not None and not matcher.consume_token(token):
            error = matcher.get_error().strip().splitlines()
            raise GrammarExhausted(f"the grammar's parser stopped at token {token}: {error[0] if error else '?'}")

    def is_complete(self, seq: Sequence) -> bool:
        """The grammar has ended: no token but EOS may follow (so a constrained sample ends with
        EOS, as vLLM's do, whose text the front end leaves out)."""
        matcher = self._matchers.get(seq)
        return matcher is not None and matcher.is_stopped()

    # ---- compiling --------------------------------------------------------------------------

    def _compile(self, key: GrammarKey) -> Future[llguidance.LLMatcher]:
        future = self._compiled.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(key)
            return future
        future = self._compiled[key] = self._pool_for().submit(self._build, key)
        while len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def _build(self, key: GrammarKey) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._vocabulary_for(), grammar_text(key), log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def _pool_for(self) -> CompilePool:
        if self._pool is None:
            self._pool = CompilePool(COMPILE_THREADS, COMPILE_STACK_BYTES, COMPILE_NICE)
        return self._pool

    def _vocabulary_for(self) -> llguidance.LLTokenizer:
        """Built once, on first use (a quarter second for a 50K vocabulary), on a pool thread."""
        with self._vocabulary_lock:
            if self._vocabulary is None:
                self._vocabulary = grammar_vocabulary(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._vocabulary

    def _executor_for(self) -> llguidance.LLExecutor:
        if self._executor is None:
            # Few threads: rayon's idle workers spin a while, taking cores from the forward pass after them.
            self._executor = llguidance.LLExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)))
        return self._executor

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class CompilePool:
    """Daemon threads with a stack of `stack_bytes` (a grammar compile recurses in native code) and
    a nice value of their own (Linux schedules threads one by one), running submitted calls."""

    def __init__(self, threads: int, stack_bytes: int, nice: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future, Callable, tuple] | None] = queue.SimpleQueue()
        self._nice = nice
        previous = threading.stack_size(stack_bytes)
        try:
            self._threads = [threading.Thread(target=self._serve, name=f"grammar-{i}", daemon=True)
                             for i in range(threads)]
            for thread in self._threads:
                thread.start()
        finally:
            threading.stack_size(previous)

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _serve(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        except (AttributeError, OSError):  # not Linux: the thread keeps the process's priority
            pass
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - the future carries it to the request
                future.set_exception(err)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
