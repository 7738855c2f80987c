"""OutputProcessor: the engine core's token ids → RequestOutputs, on the front end.

It owns what needs text: streaming detokenization, stop strings (a match ends the sample here
and the core is told to abort it), logprob token texts, and each request's timing. The offline
LLM runs it after every in-process step; the API server runs it on its event loop as the core
process's outputs arrive.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from llmpipe.engine.core_messages import EngineCoreOutput, EngineCoreOutputs, RawLogprob
from llmpipe.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llmpipe.sampling_params import SamplingParams
from llmpipe.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)
SampleKey = tuple[str, int]  # (request id, sample index)


@dataclass(eq=False)
class SampleState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error
        if reason != "error" and self.detokenizer is not None and self.detokenizer.stop_reason is None:
            self.text += self.detokenizer.finish()

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            error=self.error,
        )


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # grows as the prompt is computed
    pooled: list[float] | None = None  # a pooling request's result

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)

    @property
    def complete_prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt logprobs once every prompt token has its entry (vLLM hands them over whole)."""
        done = self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_token_ids)
        return list(self.prompt_logprobs) if done else None

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[sample.to_output() for sample in self.samples],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.complete_prompt_logprobs,
            pooled=self.pooled,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams) -> RequestState:
        samples = [SampleState(i, self._detokenizer(params), logprobs=[] if params.logprobs is not None else None)
                   for i in range(params.n)]
        state = RequestState(request_id, prompt, token_ids, params, samples, RequestMetrics(time.perf_counter()))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has nothing before it
        self.requests[request_id] = state
        return state

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, step: EngineCoreOutputs) -> tuple[list[RequestOutput], list[SampleKey]]:
        """The outputs of every request the step advanced (in first-seen order), and the samples
        the core must abort (a stop string matched, or their text failed)."""
        touched: dict[str, bool] = {}  # request id → its tokens' times are recorded for this step
        aborts: list[SampleKey] = []
        for out in step.outputs:
            state = self.requests.get(out.request_id)
            if state is None or out.index >= len(state.samples) or state.samples[out.index].finished:
                continue
            self._note_progress(state, out)
            sample = state.samples[out.index]
            added = self._append(state, sample, out)
            if sample.finished and not out.finished:
                aborts.append((out.request_id, out.index))
            if added and not touched.get(out.request_id):  # one time per token: a verified run is a burst
                state.metrics.first_token_time = state.metrics.first_token_time or step.timestamp
                state.metrics.token_times += [step.timestamp] * added
                touched[out.request_id] = True
            touched.setdefault(out.request_id, False)
        return [self._output(request_id) for request_id in touched], aborts

    def _note_progress(self, state: RequestState, out: EngineCoreOutput) -> None:
        if out.first_scheduled_time is not None:
            state.metrics.first_scheduled_time = out.first_scheduled_time
        if out.index == 0:
            state.num_cached_tokens = out.num_cached_tokens
        if out.pooled is not None:
            state.pooled = out.pooled
        if out.new_prompt_logprobs and state.prompt_logprobs is not None:
            for info in out.new_prompt_logprobs:
                token = state.prompt_token_ids[len(state.prompt_logprobs)]
                state.prompt_logprobs.append(self._logprob_entry(token, info))

    def _append(self, state: RequestState, sample: SampleState, out: EngineCoreOutput) -> int:
        """Add out's tokens to sample until one ends it; the number added."""
        new = out.new_token_ids
        for k, token in enumerate(new):
            try:
                if out.new_logprobs is not None and k < len(out.new_logprobs):
                    self._record_logprob(sample, token, out.new_logprobs[k])
                sample.token_ids.append(token)
                # EOS or a stop token ends the sample before stop strings are looked at; its text is
                # the output's only with include_stop_str_in_output (vLLM's rule)
                stop_token = k == len(new) - 1 and out.finish_reason == "stop"
                if sample.detokenizer is not None and (not stop_token or state.params.include_stop_str_in_output):
                    sample.text += sample.detokenizer.add(token)
            except Exception:  # one sample's fault (its detokenizer, stop strings) must not sink the others
                logger.exception("request %s failed; the others go on", state.request_id)
                sample.finish("error", error="the engine failed turning this request's tokens into text")
                return k + 1
            if stop_token:
                break
            stop = sample.detokenizer.stop_reason if sample.detokenizer is not None else None
            if stop is not None and len(sample.token_ids) >= state.params.min_tokens:
                sample.finish("stop", stop)
                return k + 1
        if out.finished and not sample.finished:
            sample.finish(out.finish_reason, out.stop_reason, out.error)
        return len(new)

    def _record_logprob(self, sample: SampleState, token: int, info: RawLogprob) -> None:
        sample.logprobs.append(self._logprob_entry(token, info))
        sample.cumulative_logprob += info[0]

    def _logprob_entry(self, token: int, info: RawLogprob) -> dict[int, Logprob]:
        """vLLM's logprobs dict: the top-n tokens and the chosen one, each with its rank and text."""
        logprob, rank, top = info
        entry = {tid: Logprob(lp, r + 1, self._token_text(tid)) for r, (tid, lp) in enumerate(top)}
        entry[token] = Logprob(logprob, rank, self._token_text(token))
        return entry

    def _token_text(self, token: int) -> str | None:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else None

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop_list,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def _output(self, request_id: str) -> RequestOutput:
        state = self.requests[request_id]
        if state.finished:
            state.metrics.finished_time = time.perf_counter()
            del self.requests[request_id]
        return state.to_output()
