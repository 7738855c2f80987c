"""A request and its sequences (one per sample when n > 1): tokens, status, and timing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from llmpipe.engine.kv_cache import SequenceKVCache
from llmpipe.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llmpipe.sampling_params import SamplingParams
from llmpipe.tokenizer import IncrementalDetokenizer


@dataclass
class Sequence:
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    kv: SequenceKVCache | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        if self.detokenizer is not None and self.detokenizer.stop_reason is None:
            self.text += self.detokenizer.finish()
        self.kv = None  # release the cache memory now

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Sequence]
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.perf_counter()))
    prefilled: bool = False

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[seq.to_output() for seq in self.sequences],
            finished=self.finished,
            metrics=self.metrics,
        )
