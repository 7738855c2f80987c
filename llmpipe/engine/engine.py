"""LLMEngine: requests in, one step at a time, outputs out.

This engine runs one request at a time (prefill, then one decode step per call to step());
the paged-cache, continuously batching scheduler replaces `_schedule` and `_run` later.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from llmpipe.config import EngineConfig
from llmpipe.engine.model_runner import ModelRunner
from llmpipe.engine.sequence import Request, Sequence
from llmpipe.errors import InvalidRequestError
from llmpipe.layers.sampler import SamplingRow, sample
from llmpipe.loader import load_checkpoint
from llmpipe.models import build_model
from llmpipe.outputs import Logprob, RequestOutput
from llmpipe.sampling_params import SamplingParams
from llmpipe.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        checkpoint = load_checkpoint(config.model)
        config.model_config = checkpoint.config
        model_len = checkpoint.config.max_position_embeddings
        config.max_model_len = min(config.max_model_len or model_len, model_len)
        self.config = config
        self.tokenizer: Tokenizer | None = checkpoint.tokenizer
        self.checkpoint_path = checkpoint.path
        self.file_bytes = checkpoint.file_bytes
        self.eos_token_ids = set(checkpoint.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        weights = checkpoint.iter_weights(progress=progress)
        self.model = build_model(checkpoint.config, weights, config.torch_dtype, config.device)
        self.runner = ModelRunner(self.model, config)
        self.requests: dict[str, Request] = {}
        self.queue: deque[str] = deque()

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

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
        sequences = [self._new_sequence(i, token_ids, params) for i in range(params.n)]
        self.requests[request_id] = Request(request_id, text, token_ids, params, sequences)
        self.queue.append(request_id)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.sequences:
            if not seq.finished:
                seq.finish("abort")
        if request_id in self.queue:
            self.queue.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.queue)

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

    def _new_sequence(self, index: int, token_ids: list[int], params: SamplingParams) -> Sequence:
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
        return Sequence(index, token_ids, params, detok, generator, logprobs=[] if params.logprobs is not None else None)

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advance the oldest unfinished request by one forward pass; return its output so far."""
        if not self.queue:
            return []
        request = self.requests[self.queue[0]]
        if not request.prefilled:
            self._prefill(request)
        else:
            self._decode(request)
        output = request.to_output()
        if request.finished:
            request.metrics.finished_time = time.perf_counter()
            self.queue.popleft()
            del self.requests[request.request_id]
        return [output]

    def _capacity(self, request: Request) -> int:
        budget = request.params.max_tokens or self.config.max_model_len
        return min(len(request.prompt_token_ids) + budget, self.config.max_model_len)

    def _prefill(self, request: Request) -> None:
        request.metrics.first_scheduled_time = time.perf_counter()
        first = request.sequences[0]
        first.kv = self.runner.allocate(self._capacity(request))
        logits = self.runner.prefill(request.prompt_token_ids, first.kv)
        for seq in request.sequences[1:]:
            seq.kv = first.kv.fork(len(request.prompt_token_ids))
        request.prefilled = True
        self._sample_and_append(request, request.sequences, logits.expand(len(request.sequences), -1))

    def _decode(self, request: Request) -> None:
        running = [seq for seq in request.sequences if not seq.finished]
        logits = torch.cat([self.runner.decode(seq.all_token_ids, seq.kv) for seq in running])
        self._sample_and_append(request, running, logits)

    def _sample_and_append(self, request: Request, seqs: list[Sequence], logits: torch.Tensor) -> None:
        rows = [self._sampling_row(seq) for seq in seqs]
        result = sample(logits, rows)
        now = time.perf_counter()
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.token_times.append(now)
        for i, (seq, token) in enumerate(zip(seqs, result.token_ids)):
            if result.logprobs[i] is not None:
                self._record_logprobs(seq, token, result.logprobs[i])
            self._append_token(seq, token)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        banned: list[int] = []
        if len(seq.output_token_ids) < seq.params.min_tokens:
            banned = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(self.eos_token_ids))
        return SamplingRow(seq.params, seq.generator, seq.prompt_token_ids, seq.output_token_ids, banned)

    def _record_logprobs(self, seq: Sequence, token: int, info: tuple[float, int, list[tuple[int, float]]]) -> None:
        logprob, rank, top = info
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else (lambda t: None)
        entry = {tid: Logprob(lp, r + 1, decode(tid)) for r, (tid, lp) in enumerate(top)}
        entry[token] = Logprob(logprob, rank, decode(token))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += logprob

    def _append_token(self, seq: Sequence, token: int) -> None:
        """Record the token, stream its text, and decide whether the sequence is done."""
        seq.output_token_ids.append(token)
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
