"""EngineCore: the model, the KV cache, the scheduler, the sampler and the speculative proposer.

Token ids in (`EngineCoreRequest`), token ids out (`EngineCoreOutputs`): text never reaches it.
Each step is three calls, vLLM v1's shape: the scheduler picks a batch (decodes + prefill chunks)
under the token budget, the runner computes it in one forward pass over the paged KV cache, and
`_update_from_output` samples, appends and applies the token-level stop rules (EOS, stop token
ids, max_tokens, the context). Stop strings need text, so the front end checks them and aborts
the sample that matched one.

The offline `LLM` runs this core in-process; `llmpipe serve` runs it in a process of its own
(`core_process.py`), so the model's compute never contends with HTTP for the GIL.
"""

from __future__ import annotations

import itertools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np
import torch

from llmpipe.config import EngineConfig
from llmpipe.engine.admission import Admission
from llmpipe.engine.block_manager import BlockManager
from llmpipe.engine.cache_kinds import BlockTable
from llmpipe.engine.core_messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from llmpipe.engine.kv_cache import plan_kv_pool
from llmpipe.engine.model_runner import ModelRunner, Runner
from llmpipe.engine.scheduler import Scheduler, SchedulerOutput
from llmpipe.engine.sequence import Request, Sequence
from llmpipe.engine.step_costs import StepCosts
from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.kernels import huge_pages
from llmpipe.layers.sampler import DeadEndError, SamplingRow, adjusted_logits, ranked_logprobs, sample, topn_logprobs
from llmpipe.loader import load_checkpoint
from llmpipe.loader.memory_check import auto_kv_pool, available_bytes, check_fits
from llmpipe.models import load_model, resident_bytes
from llmpipe.models.registry import family_of
from llmpipe.sampling_params import SamplingParams
from llmpipe.spec import Proposal, Proposer, verify
from llmpipe.spec.draft import DraftProposer
from llmpipe.spec.ngram import NgramProposer
from llmpipe.structured_output import StructuredOutputManager
from llmpipe.structured_output.bitmask import any_token_left
from llmpipe.structured_output.manager import GRAMMAR_END, GrammarExhausted

logger = logging.getLogger(__name__)
GRAMMAR_WAIT_S = 0.05  # a step with only requests whose grammars compile waits this long at most
PROMPT_LOGPROB_SLICE = 256  # prompt rows turned into logprobs at a time


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # proposals verified (one per sequence per step)
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposed tokens the target kept

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    num_blocks: int
    num_free_blocks: int
    peak_blocks_in_use: int
    # Bytes a token adds to a sequence's cache once it is longer than every window: the layers that
    # keep all tokens (all layers for a model without windows). Window layers hold ~W tokens instead.
    kv_bytes_per_token: int
    prefix_cache_queries: int  # prompt blocks looked up
    prefix_cache_hits: int  # prompt blocks served from the cache
    num_preemptions: int
    num_prefill_tokens: int  # prompt tokens actually computed (cache hits excluded)
    num_generation_tokens: int
    kv_bytes_in_use: int = 0  # bytes of the blocks in use
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding on
    kv_bytes_per_seq: dict[str, int] = field(default_factory=dict)  # running request → bytes its blocks hold


@dataclass(frozen=True)
class CoreInfo:
    """What a front end needs to know of the core it talks to: limits and ids for admission."""

    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    weight_bytes: int
    pid: int


class EngineCore:
    def __init__(self, config: EngineConfig, *, progress: bool = True):
        config = replace(config)  # resolved here (the checkpoint's config, max_model_len): the caller's stays as given
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        checkpoint = load_checkpoint(config.model)
        family_of(checkpoint.config.architecture).check_engine_options(config)
        if config.disable_sliding_window:  # every layer attends to (and caches) all tokens
            checkpoint.config = replace(checkpoint.config, sliding_window=None)
        config.model_config = checkpoint.config
        self.config = config
        self.checkpoint = checkpoint
        self.eos_token_ids = set(checkpoint.config.eos_token_ids)
        if checkpoint.tokenizer is not None and checkpoint.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(checkpoint.tokenizer.eos_token_id)
        # This process's share (rank 0's under tensor parallelism); a block count is sized after the model.
        weight_bytes, available = checkpoint.file_bytes // config.tensor_parallel_size, available_bytes()
        if config.kv_cache_memory == "auto":
            config.kv_cache_memory = auto_kv_pool(weight_bytes, available)
        check_fits(str(config.model), weight_bytes, 0 if config.max_num_blocks else config.kv_cache_memory, available)
        if config.tensor_parallel_size > 1:  # rank 0's shard here; the executor starts the other ranks
            from llmpipe.distributed.executor import TensorParallelExecutor

            self.runner = TensorParallelExecutor(checkpoint, config, progress)
            self.model = self.runner.model
        else:
            self.model = load_model(checkpoint, config, progress)
        # Per rank under tensor parallelism: self.model.config has rank 0's KV heads (the most).
        self.kv_layout, self.block_bytes, num_blocks = plan_kv_pool(config, self.model.config)
        self._set_max_model_len(self.kv_layout.max_tokens(
            num_blocks, config.block_size, config.max_num_batched_tokens, checkpoint.config.max_position_embeddings
        ))
        specs = [group.spec for group in self.kv_layout.groups]
        self.block_manager = BlockManager(
            num_blocks, config.block_size, specs, config.enable_prefix_caching and config.kv_cache,
            copy_partial_blocks=True,
        )
        self.structured = StructuredOutputManager(checkpoint.tokenizer, checkpoint.config.vocab_size,
                                                  self.eos_token_ids)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.structured.is_ready)
        if config.tensor_parallel_size > 1:
            self.runner.start(num_blocks, self.kv_layout)
        else:
            self.runner: Runner = ModelRunner(self.model, config, num_blocks, self.kv_layout)
        self.proposer = self._build_proposer(progress)
        self.spec_stats = SpecDecodeStats()
        self.step_costs = StepCosts(config.max_decode_stall, config.max_num_seqs)
        self.admission = Admission(None, config.max_model_len, config.model_config.vocab_size)
        self.requests: dict[str, Request] = {}
        self.num_prefill_tokens = 0
        self.num_generation_tokens = 0

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected or the
        interpreter exits); the core cannot step afterwards."""
        self.structured.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def fault_in_kv_cache(self) -> None:
        """The KV cache's pages taken now, before a server's first request (huge_pages.fault_in); the
        ranks of a tensor-parallel runner keep theirs lazy."""
        for tensor in getattr(self.runner.kv_cache, "tensors", ()):
            huge_pages.fault_in(tensor)

    def info(self, pid: int) -> CoreInfo:
        return CoreInfo(
            self.config.model, self.config.max_model_len, self.config.model_config.vocab_size,
            tuple(sorted(self.eos_token_ids)), self.weight_bytes, pid,
        )

    def _build_proposer(self, progress: bool) -> Proposer | None:
        config = self.config
        if config.speculative_method is not None and not config.kv_cache:
            raise LLMPipeError("speculative decoding verifies against the KV cache: it needs kv_cache=True")
        if config.speculative_method == "ngram":
            return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        if config.speculative_method == "draft":
            return DraftProposer(config, config.model_config, self._sampling_row, progress)
        return None

    def _set_max_model_len(self, pool_tokens: int) -> None:
        model_len = self.config.model_config.max_position_embeddings
        wanted = min(self.config.max_model_len or model_len, model_len)
        if wanted > pool_tokens:
            logger.warning("max_model_len %d capped to the KV cache's %d tokens", wanted, pool_tokens)
        self.config.max_model_len = min(wanted, pool_tokens)

    @property
    def weight_bytes(self) -> int:
        """Resident weights: parameters and persistent buffers (quantized weights, their scales), each
        once; under tensor parallelism, rank 0's shard (`runner.rank_memory()` has every rank's)."""
        return resident_bytes(self.model)

    def stats(self) -> EngineStats:
        blocks = self.block_manager
        per_seq: dict[str, int] = {}
        for seq in self.scheduler.running:
            per_seq[seq.request_id] = per_seq.get(seq.request_id, 0) + blocks.blocks_held(seq) * self.block_bytes
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=blocks.usage,
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            peak_blocks_in_use=blocks.peak_blocks_in_use,
            kv_bytes_per_token=self.kv_layout.growth_bytes_per_token(self.runner.kv_cache.bytes_per_token),
            prefix_cache_queries=blocks.prefix_queries,
            prefix_cache_hits=blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefill_tokens=self.num_prefill_tokens,
            num_generation_tokens=self.num_generation_tokens,
            kv_bytes_in_use=(blocks.num_blocks - blocks.num_free_blocks) * self.block_bytes,
            kv_bytes_per_seq=per_seq,
            spec_decode=replace(self.spec_stats) if self.proposer is not None else None,
        )

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admit a request the front end checked (`Admission.prompt`); the same rules are checked
        again here, so a front end that skipped them cannot get a bad id into a batch."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        token_ids, params = request.prompt_token_ids, request.params
        self.admission.check(token_ids, params)
        sequences = [self._new_sequence(request.request_id, i, token_ids, params) for i in range(params.n)]
        self.structured.add_request(request.request_id, params)  # compiles off the step
        self.requests[request.request_id] = Request(request.request_id, token_ids, params, sequences)
        self.scheduler.add(sequences[0])

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or one of its samples) now and free its KV blocks at once."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.sequences:
            if index is None or seq.index == index:
                if not seq.finished:
                    seq.finish("abort")
                self._release(seq)
        if request.finished:
            del self.requests[request_id]
            self.structured.forget_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _new_sequence(self, request_id: str, index: int, token_ids: list[int], params: SamplingParams) -> Sequence:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.config.device).manual_seed(params.seed + index)
        seq = Sequence(request_id, index, list(token_ids), params, generator)
        seq.new_logprobs = [] if params.logprobs is not None else None
        return seq

    # ---- stepping: schedule → execute → update from the output ------------------------------

    def step(self) -> EngineCoreOutputs:
        """Schedule and run one batch: the progress of every request it advanced."""
        started = time.perf_counter()
        batch = self.scheduler.schedule(self.step_costs.prefill_budget)
        if batch.empty:
            if batch.num_held:  # as the scheduler saw them: a compile may have finished since
                self.structured.wait_for_compiles(GRAMMAR_WAIT_S)  # nothing else can run meanwhile
                return EngineCoreOutputs([], time.perf_counter())
            if self.scheduler.has_work():
                raise LLMPipeError("scheduler made no progress: the KV cache is too small for any waiting request")
            return EngineCoreOutputs([], time.perf_counter())
        now = time.perf_counter()
        for item in batch.prefills:
            request = self.requests[item.seq.request_id]
            request.first_scheduled_time = request.first_scheduled_time or now
        proposals = self._propose(batch)
        if self.proposer is not None:
            self.proposer.prefill([item.seq for item in batch.prefills if item.completes_prefill])
        logits = self.runner.execute(batch)
        outputs = self._update_from_output(batch, logits, proposals)
        self.step_costs.observe(len(batch.decodes) + sum(item.num_tokens for item in batch.prefills),
                                time.perf_counter() - started)
        return outputs

    def step_guarded(self) -> EngineCoreOutputs:
        """A step whose batch-level fault fails the requests in flight instead of raising: the
        engine keeps serving the next ones."""
        try:
            return self.step()
        except Exception as err:
            logger.exception("engine step failed; failing the requests in flight")
            outputs = []
            for request_id in list(self.requests):
                for seq in self.requests[request_id].sequences:
                    if not seq.finished:
                        seq.fail(f"the engine's step failed ({type(err).__name__})")
                        outputs.append(seq.take_output())
                self.abort(request_id)
            return EngineCoreOutputs(outputs, time.perf_counter())

    def _update_from_output(
        self, batch: SchedulerOutput, logits: torch.Tensor, proposals: dict[Sequence, Proposal]
    ) -> EngineCoreOutputs:
        sampled = batch.decodes + [item.seq for item in batch.prefills if item.completes_prefill]
        prompt_positions = [(item.seq, item.seq.prompt_logprob_positions(
            item.seq.num_computed_tokens, item.seq.num_computed_tokens + item.num_tokens)) for item in batch.prefills]
        self.scheduler.update_from_output(batch)
        self.num_prefill_tokens += sum(item.num_tokens for item in batch.prefills)
        widths = [1 + len(batch.draft_token_ids.get(seq, ())) for seq in sampled]
        starts = [0, *itertools.accumulate(widths)]
        failed = self._record_prompt_logprobs(logits[starts[-1] :], prompt_positions)
        rows, seqs = self._with_forked_siblings(sampled)
        self._sample_and_append(seqs, logits, [(starts[r], widths[r]) for r in rows], proposals)
        if not self.config.kv_cache:
            self.scheduler.forget_computed(seqs)
        timestamp = time.perf_counter()
        advanced = dict.fromkeys(seqs + [item.seq for item in batch.prefills] + failed)
        return EngineCoreOutputs(self._collect_outputs(advanced), timestamp)

    def _record_prompt_logprobs(self, logits: torch.Tensor, positions: list[tuple[Sequence, range]]) -> list[Sequence]:
        """logits: the prompt-logprob rows the runner appended, positions[i]'s after positions[i - 1]'s.
        A request whose prompt logprobs fail fails whole: its other samples would start from this one's
        blocks. Returns the samples failed."""
        failed: list[Sequence] = []
        first = 0
        for seq, span in positions:
            rows, first = logits[first : first + len(span)], first + len(span)
            if not span:
                continue
            try:
                targets = seq.prompt_token_ids[span.start + 1 : span.stop + 1]
                for at in range(0, len(span), PROMPT_LOGPROB_SLICE):  # bounds the float32 copies' memory
                    part = rows[at : at + PROMPT_LOGPROB_SLICE].float().log_softmax(dim=-1)
                    seq.add_prompt_logprobs(
                        ranked_logprobs(part, targets[at : at + PROMPT_LOGPROB_SLICE], seq.params.prompt_logprobs))
            except Exception:  # one sequence's fault must not sink the batch
                logger.exception("request %s failed computing its prompt logprobs; the others go on", seq.request_id)
                for sibling in self.requests[seq.request_id].sequences:
                    if not sibling.finished:
                        sibling.fail("the engine failed computing this request's prompt logprobs")
                        self._release(sibling)
                        failed.append(sibling)
        return failed

    def _propose(self, batch: SchedulerOutput) -> dict[Sequence, Proposal]:
        """Draft tokens for this step's decodes, each capped so it cannot run past max_tokens or the
        context; the scheduler keeps those the cache has blocks for, and they join the batch."""
        if self.proposer is None or not batch.decodes:
            return {}
        k = self.config.num_speculative_tokens
        limits = []
        for seq in batch.decodes:
            left = self.config.max_model_len - seq.num_tokens
            if seq.params.max_tokens is not None:
                left = min(left, seq.params.max_tokens - len(seq.output_token_ids))
            limits.append(min(k, left - 1))
        proposals = self.proposer.propose(batch.decodes, limits)
        kept = self.scheduler.add_drafts(batch, {seq: p.token_ids for seq, p in proposals.items()})
        return {seq: proposals[seq] for seq in kept}

    def _with_forked_siblings(self, sampled: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """When sample 0 of an n > 1 request has prefilled its prompt, the other samples start from
        its blocks (sharing full blocks, copying the partial last one) and sample from its logits."""
        rows, seqs = list(range(len(sampled))), list(sampled)
        for row, seq in enumerate(sampled):
            request = self.requests[seq.request_id]
            if request.forked or len(request.sequences) == 1:
                continue
            request.forked = True
            for sibling in request.sequences[1:]:
                if sibling.finished:  # aborted before it started
                    continue
                if not self.scheduler.fork(seq, sibling):
                    continue
                rows.append(row)
                seqs.append(sibling)
        return rows, seqs

    def _collect_outputs(self, seqs: dict[Sequence, None]) -> list[EngineCoreOutput]:
        outputs = []
        for seq in seqs:
            request = self.requests.get(seq.request_id)
            if request is None:
                continue
            first_scheduled = None
            if not request.scheduled_sent:
                request.scheduled_sent, first_scheduled = True, request.first_scheduled_time
            outputs.append(seq.take_output(first_scheduled))
        for output in outputs:
            request = self.requests.get(output.request_id)
            if request is not None and request.finished:
                del self.requests[output.request_id]
                self.structured.forget_request(output.request_id)
        return outputs

    def _sample_and_append(
        self, seqs: list[Sequence], logits: torch.Tensor, spans: list[tuple[int, int]], proposals: dict[Sequence, Proposal]
    ) -> None:
        """spans[i]: (first row, rows) of seqs[i]'s logits, one row per token fed (its newest token
        and any drafts)."""
        if not seqs:
            return
        emitted: list[tuple[list[int], list]] = [([], [])] * len(seqs)
        for seq in seqs if self.structured.active else ():
            error = self.structured.prepare(seq)
            if error is not None:
                seq.fail(error)
        plain = [i for i, seq in enumerate(seqs) if seq not in proposals and not seq.finished]
        for i, sampled in self._sample_each_or_alone(logits, [spans[i][0] for i in plain], [seqs[i] for i in plain]):
            emitted[plain[i]] = sampled
        for i, seq in enumerate(seqs):
            if seq in proposals and not seq.finished:
                start, width = spans[i]
                try:
                    emitted[i] = self._verify(seq, logits[start : start + width], proposals[seq])
                except DeadEndError as err:
                    seq.fail(str(err))
                except Exception:
                    logger.exception("request %s failed verifying its drafts; the others go on", seq.request_id)
                    seq.fail("the engine failed verifying this request's speculative tokens")
        for seq, (tokens, logprobs) in zip(seqs, emitted):
            self._emit(seq, tokens, logprobs)
            if seq in proposals and not seq.finished:
                self.scheduler.accept_drafts(seq, len(tokens) - 1)
            if seq.finished:
                self._release(seq)

    def _sample_each_or_alone(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]):
        """(i, ([token], [logprobs])) for each seqs[i], sampled from logits[rows[i]] in one batch. If
        the batch raises, each row is sampled alone so that only the sequences at fault fail."""
        if not seqs:
            return []
        bitmasks = self.structured.fill_bitmasks(seqs)  # the whole batch's at once
        sampling_rows = [self._sampling_row(seq, bitmask=bitmask) for seq, bitmask in zip(seqs, bitmasks)]
        # Every row in order (each step that samples every sequence's last position): no copy of the
        # logits (an indexed copy of Gemma 3's 262,144 took ~140 us a step).
        picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
        try:
            result = sample(picked, sampling_rows)
            return [(i, ([token], [lp])) for i, (token, lp) in enumerate(zip(result.token_ids, result.logprobs))]
        except DeadEndError:
            pass  # the rows at fault fail below, alone
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling each sequence alone", len(seqs))
        sampled = []
        for i, (row, seq) in enumerate(zip(rows, seqs)):
            try:
                result = sample(logits[[row]], [sampling_rows[i]])
                sampled.append((i, (result.token_ids, result.logprobs)))
            except DeadEndError as err:
                seq.fail(str(err))
            except Exception:
                logger.exception("request %s failed sampling; the others go on", seq.request_id)
                seq.fail("the engine failed sampling this request's next token")
        return sampled

    def _verify(self, seq: Sequence, logits: torch.Tensor, proposal: Proposal) -> tuple[list[int], list]:
        """Rejection-sample the drafts against the target's rows; the accepted ones plus one more token."""
        drafts = proposal.token_ids
        bitmasks = self.structured.fill_bitmasks_through_drafts(seq, drafts)
        rows = [self._sampling_row(seq, drafts[:i], bitmasks[i]) for i in range(len(drafts) + 1)]
        tokens = verify(adjusted_logits(logits, rows), rows, proposal)
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += len(tokens) - 1
        return tokens, topn_logprobs(logits[: len(tokens)], tokens, rows[: len(tokens)])

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list) -> None:
        """Append tokens in order until one ends the sequence (EOS, a stop token, max_tokens)."""
        for token, info in zip(tokens, logprobs):
            if seq.finished:
                break
            try:
                if info is not None and seq.new_logprobs is not None:
                    logprob, rank, top = info
                    seq.new_logprobs.append((float(logprob), int(rank), [(int(t), float(lp)) for t, lp in top]))
                self._append_token(seq, token)
            except Exception:  # one sequence's fault must not sink the batch
                logger.exception("request %s failed; the others go on", seq.request_id)
                seq.fail("the engine failed handling this request's tokens")
            self.num_generation_tokens += 1

    def _release(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's blocks (and its draft's) at once."""
        self.scheduler.finish(seq)
        self.structured.release(seq)
        if self.proposer is not None:
            self.proposer.release(seq)

    def _sampling_row(self, seq: Sequence, drafts: list[int] = (), bitmask: np.ndarray | None = None) -> SamplingRow:
        """The sampling rules for seq's next token, after `drafts` if it is a speculative position;
        `bitmask`: the tokens its grammar allows there."""
        output = seq.output_token_ids + list(drafts) if drafts else seq.output_token_ids
        banned: list[int] = []
        if len(output) < seq.params.min_tokens:
            banned = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(self.eos_token_ids))
            if bitmask is not None and not any_token_left(bitmask, banned):
                banned = []  # the grammar can only end here: its end outranks min_tokens (GRAMMAR_END)
        return SamplingRow(seq.params, seq.generator, seq.prompt_token_ids, output, banned, bitmask)

    def _append_token(self, seq: Sequence, token: int) -> None:
        """Record the token and apply the token-level stop rules (stop strings: the front end's)."""
        seq.append_token(token)
        try:
            self.structured.advance(seq, token)
        except GrammarExhausted as err:
            # The token was one the grammar allowed: its parser ran out of llguidance's limits. The
            # output so far is a valid prefix, cut short by a limit as max_tokens would cut it.
            logger.warning("request %s: %s; its output ends here", seq.request_id, err)
            seq.finish("length")
            return
        params = seq.params
        may_stop = len(seq.output_token_ids) >= params.min_tokens
        if may_stop and token in params.stop_token_ids:
            seq.finish("stop", token)
        elif may_stop and not params.ignore_eos and token in self.eos_token_ids:
            seq.finish("stop")
        elif token in self.eos_token_ids and self.structured.is_complete(seq):
            # ignore_eos, or under min_tokens, but the grammar has ended: it allowed nothing but EOS
            seq.finish("stop", None if may_stop else GRAMMAR_END)
        elif params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            seq.finish("length")
        elif seq.num_tokens >= self.config.max_model_len:
            seq.finish("length")

    # ---- evaluation -----------------------------------------------------------------------

    def score(self, token_ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Logits at every position of token_ids (or the last), computed from scratch (evaluation, tests)."""
        with self.scratch_blocks(token_ids) as block_tables:
            return self.runner.score(token_ids, block_tables, last_only)

    @contextmanager
    def scratch_blocks(self, token_ids: list[int]) -> Iterator[list[BlockTable]]:
        """A block table for token_ids outside the scheduler (scoring, calibration), freed on exit."""
        scratch = Sequence("score", 0, list(token_ids), SamplingParams(), None)
        no_hit = self.block_manager.no_hit()  # computed from scratch
        # Queued copies first: a block the scratch takes may be one's source (freed since it was queued).
        self.runner.copy_blocks(self.block_manager.take_block_copies())
        if not self.block_manager.can_allocate(scratch, no_hit, len(token_ids)):
            raise InvalidRequestError(f"{len(token_ids)} tokens do not fit the free KV cache blocks")
        self.block_manager.allocate(scratch, no_hit, len(token_ids))
        try:
            yield scratch.block_tables
        finally:
            self.block_manager.free_sequence(scratch)

