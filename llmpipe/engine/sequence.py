"""A request and its sequences (one per sample when n > 1): tokens, KV blocks, status, timing."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from llmpipe.engine.block_manager import BlockTable
from llmpipe.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llmpipe.sampling_params import SamplingParams
from llmpipe.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)  # prompt + output, grown in place (no copy per step)
    status: SequenceStatus = SequenceStatus.WAITING
    block_tables: list[BlockTable] = field(default_factory=list)  # one per KV cache group
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hashes of its full blocks
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, served by the prefix cache at admission
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why it finished with "error"
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)

    @property
    def in_prefill(self) -> bool:
        """More than the newest token still lacks K/V (a prompt, or a resumed preempted sequence)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.status = SequenceStatus.FINISHED
        if self.detokenizer is not None and self.detokenizer.stop_reason is None:
            self.text += self.detokenizer.finish()

    def fail(self, error: str) -> None:
        """End this sequence alone: one request's fault must not sink the batch it ran in."""
        self.finish_reason, self.error, self.status = "error", error, SequenceStatus.FINISHED

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            error=self.error,
        )


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Sequence]
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.perf_counter()))
    forked: bool = False  # samples 1..n-1 start once sample 0 has prefilled the shared prompt

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
            num_cached_tokens=self.sequences[0].num_cached_tokens,
        )
