"""LLMEngine: requests in, one scheduled step at a time, outputs out.

Each step the scheduler picks a batch (decodes + prefill chunks) under the token budget, the
model runner computes it in one forward pass over the paged KV cache, and the sampler picks the
next token of every sequence that finished its prefill or decoded.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from llmpipe.config import EngineConfig
from llmpipe.engine.block_manager import BlockManager, BlockTable, PrefixHit
from llmpipe.engine.kv_cache import kv_bytes_per_token
from llmpipe.engine.kv_cache_spec import kv_cache_layout
from llmpipe.engine.model_runner import ModelRunner
from llmpipe.engine.scheduler import Scheduler, SchedulerOutput
from llmpipe.engine.sequence import Request, Sequence, SequenceStatus
from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.layers.sampler import SamplingRow, sample
from llmpipe.loader import load_checkpoint
from llmpipe.models import build_model
from llmpipe.outputs import Logprob, RequestOutput
from llmpipe.sampling_params import SamplingParams
from llmpipe.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict


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
    kv_bytes_per_seq: dict[str, int] = field(default_factory=dict)  # running request → bytes its blocks hold


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        checkpoint = load_checkpoint(config.model)
        if config.disable_sliding_window:  # every layer attends to (and caches) all tokens
            checkpoint.config = replace(checkpoint.config, sliding_window=None)
        config.model_config = checkpoint.config
        self.config = config
        self.tokenizer: Tokenizer | None = checkpoint.tokenizer
        self.checkpoint_path = checkpoint.path
        self.file_bytes = checkpoint.file_bytes
        self.eos_token_ids = set(checkpoint.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        plan = checkpoint.quant_plan(config.weight_quantization, config.group_size)
        weights = checkpoint.iter_weights(progress=progress, plan=plan)
        self.model = build_model(checkpoint.config, weights, config.torch_dtype, config.device, plan)
        self.kv_layout = kv_cache_layout(checkpoint.config)
        self.block_bytes = self.kv_layout.block_bytes(
            kv_bytes_per_token(checkpoint.config, config.torch_dtype, config.kv_cache_dtype), config.block_size
        )
        num_blocks = config.max_num_blocks or config.kv_cache_memory // self.block_bytes
        if num_blocks < 1:
            raise LLMPipeError(f"kv_cache_memory={config.kv_cache_memory} bytes holds no KV block of this model")
        self._set_max_model_len(self.kv_layout.max_tokens(
            num_blocks, config.block_size, config.max_num_batched_tokens, checkpoint.config.max_position_embeddings
        ))
        specs = [group.spec for group in self.kv_layout.groups]
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching and config.kv_cache, specs
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, config, num_blocks, self.kv_layout)
        self.requests: dict[str, Request] = {}
        self.num_prefill_tokens = 0
        self.num_generation_tokens = 0

    def _set_max_model_len(self, pool_tokens: int) -> None:
        model_len = self.config.model_config.max_position_embeddings
        wanted = min(self.config.max_model_len or model_len, model_len)
        if wanted > pool_tokens:
            logger.warning("max_model_len %d capped to the KV cache's %d tokens", wanted, pool_tokens)
        self.config.max_model_len = min(wanted, pool_tokens)

    @property
    def weight_bytes(self) -> int:
        """Resident weights: parameters and persistent buffers (quantized weights, their scales), each once."""
        tensors = {t.data_ptr(): t for t in self.model.state_dict().values()}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def kv_bytes_per_sequence(self, num_tokens: int) -> int:
        """Bytes of KV blocks one sequence of num_tokens computed tokens holds (window groups capped)."""
        return self.kv_layout.blocks_held(num_tokens, self.config.block_size) * self.block_bytes

    def stats(self) -> EngineStats:
        blocks = self.block_manager
        full_layers = sum(len(g.layers) for g in self.kv_layout.groups if g.spec.window is None)
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
            kv_bytes_per_token=self.runner.kv_cache.bytes_per_token * full_layers // self.kv_layout.num_layers,
            prefix_cache_queries=blocks.prefix_queries,
            prefix_cache_hits=blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefill_tokens=self.num_prefill_tokens,
            num_generation_tokens=self.num_generation_tokens,
            kv_bytes_in_use=(blocks.num_blocks - blocks.num_free_blocks) * self.block_bytes,
            kv_bytes_per_seq=per_seq,
        )

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        limit = self.config.max_model_len
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(token_ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens, over the context limit: at most {limit - 1} "
                f"leave room for one generated token (max_model_len={limit})"
            )
        if params.stop_list and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none")
        sequences = [self._new_sequence(request_id, i, token_ids, params) for i in range(params.n)]
        self.requests[request_id] = Request(request_id, text, token_ids, params, sequences)
        self.scheduler.add(sequences[0])

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.sequences:
            if not seq.finished:
                seq.finish("abort")
            self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(list(prompt["prompt_token_ids"]))
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, self._check_ids(list(prompt))

    def _check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.config.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt_token_ids must be integers in [0, {vocab}), got {bad[0]!r}")
        return ids

    def _new_sequence(self, request_id: str, index: int, token_ids: list[int], params: SamplingParams) -> Sequence:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.config.device).manual_seed(params.seed + index)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop_list,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        logprobs = [] if params.logprobs is not None else None
        return Sequence(request_id, index, list(token_ids), params, detok, generator, logprobs=logprobs)

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; return the output so far of every request it advanced."""
        batch = self.scheduler.schedule()
        if batch.empty:
            if self.scheduler.has_work():
                raise LLMPipeError("scheduler made no progress: the KV cache is too small for any waiting request")
            return []
        now = time.perf_counter()
        for item in batch.prefills:
            metrics = self.requests[item.seq.request_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        sampled = batch.decodes + [item.seq for item in batch.prefills if item.completes_prefill]
        logits = self.runner.run(batch)
        self._advance_computed(batch)
        rows, seqs = self._with_forked_siblings(sampled)
        touched = self._sample_and_append(seqs, logits[rows])
        if not self.config.kv_cache:  # recompute mode: forget the K/V, recompute everything next step
            for seq in seqs:
                seq.num_computed_tokens = 0
        return self._collect_outputs(touched | {item.seq.request_id for item in batch.prefills})

    def _advance_computed(self, batch: SchedulerOutput) -> None:
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        for item in batch.prefills:
            item.seq.num_computed_tokens += item.num_tokens
            self.num_prefill_tokens += item.num_tokens
        for seq in batch.decodes + [item.seq for item in batch.prefills]:
            self.block_manager.register_full_blocks(seq, seq.num_computed_tokens)
            self.block_manager.free_out_of_window(seq)  # at once, so usage and stats show what is held

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
                if not self.block_manager.can_fork(seq):
                    self.scheduler.add(sibling)  # no block to copy into: prefill it (prefix cache hits)
                    continue
                for copy in self.block_manager.fork(seq, sibling):
                    self.runner.kv_cache.copy_block(*copy)
                sibling.num_computed_tokens = seq.num_computed_tokens
                sibling.status = SequenceStatus.RUNNING
                self.scheduler.running.append(sibling)
                rows.append(row)
                seqs.append(sibling)
        return rows, seqs

    def _collect_outputs(self, request_ids: set[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests[request_id]
            outputs.append(request.to_output())
            if request.finished:
                request.metrics.finished_time = time.perf_counter()
                del self.requests[request_id]
        return outputs

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> set[str]:
        if not seqs:
            return set()
        result = sample(logits, [self._sampling_row(seq) for seq in seqs])
        now = time.perf_counter()
        touched: set[str] = set()
        for seq, token, logprobs in zip(seqs, result.token_ids, result.logprobs):
            request = self.requests[seq.request_id]
            if request.request_id not in touched:
                request.metrics.first_token_time = request.metrics.first_token_time or now
                request.metrics.token_times.append(now)
                touched.add(request.request_id)
            try:
                if logprobs is not None:
                    self._record_logprobs(seq, token, logprobs)
                self._append_token(seq, token)
            except Exception:  # one sequence's fault (its detokenizer, stop strings) must not sink the batch
                logger.exception("request %s failed; the others go on", seq.request_id)
                seq.finish_reason, seq.status = "error", SequenceStatus.FINISHED
            if seq.finished:
                self.scheduler.finish(seq)
        self.num_generation_tokens += len(seqs)
        return touched

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        banned: list[int] = []
        if len(seq.output_token_ids) < seq.params.min_tokens:
            banned = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(self.eos_token_ids))
        return SamplingRow(seq.params, seq.generator, seq.prompt_token_ids, seq.output_token_ids, banned)

    def _record_logprobs(self, seq: Sequence, token: int, info: tuple[float, int, list[tuple[int, float]]]) -> None:
        logprob, rank, top = info
        entry = {tid: Logprob(lp, r + 1, self._token_text(tid)) for r, (tid, lp) in enumerate(top)}
        entry[token] = Logprob(logprob, rank, self._token_text(token))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += logprob

    def _token_text(self, token: int) -> str | None:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else None

    def _append_token(self, seq: Sequence, token: int) -> None:
        """Record the token, stream its text, and decide whether the sequence is done."""
        seq.append_token(token)
        params = seq.params
        may_stop = len(seq.output_token_ids) >= params.min_tokens
        if seq.detokenizer is not None:
            seq.text += seq.detokenizer.add(token)
        if may_stop and token in params.stop_token_ids:
            seq.finish("stop", token)
        elif may_stop and not params.ignore_eos and token in self.eos_token_ids:
            seq.finish("stop")
        elif may_stop and seq.detokenizer is not None and seq.detokenizer.stop_reason is not None:
            seq.finish("stop", seq.detokenizer.stop_reason)
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
        scratch = Sequence("score", 0, list(token_ids), SamplingParams(), None, None)
        no_hit = PrefixHit(0, [BlockTable() for _ in self.block_manager.specs])  # computed from scratch
        if not self.block_manager.can_allocate(scratch, no_hit, len(token_ids)):
            raise InvalidRequestError(f"{len(token_ids)} tokens do not fit the free KV cache blocks")
        self.block_manager.allocate(scratch, no_hit, len(token_ids))
        try:
            yield scratch.block_tables
        finally:
            self.block_manager.free_sequence(scratch)
