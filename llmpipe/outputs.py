"""What a request gives back: vLLM's RequestOutput / CompletionOutput shape, plus timing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: Optional[str] = None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    token_times: list[float] = field(default_factory=list)
    finished_time: Optional[float] = None

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: arrival → first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive generated tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def mean_itl(self) -> Optional[float]:
        gaps = self.itl
        return sum(gaps) / len(gaps) if gaps else None

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        gaps = self.itl
        return len(gaps) / sum(gaps) if gaps and sum(gaps) > 0 else None

    def timing_breakdown(self) -> dict[str, Optional[float] | int]:
        """Where this request's time went, in seconds: the `llmpipe_timing` field of server replies.

        queue: arrival → first scheduled; prefill: first scheduled → first token (so queue +
        prefill = TTFT); decode: first token → last token.
        """
        prefill = decode = None
        if self.first_scheduled_time is not None and self.first_token_time is not None:
            prefill = self.first_token_time - self.first_scheduled_time
        if self.token_times:
            decode = self.token_times[-1] - self.token_times[0]
        return {
            "queue_s": self.queue_time,
            "prefill_s": prefill,
            "decode_s": decode,
            "ttft_s": self.ttft,
            "mean_itl_s": self.mean_itl,
            "output_tokens": len(self.token_times),
        }


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[int | str] = None  # the stop string or stop token id that ended it
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    error: Optional[str] = None  # with finish_reason "error": what failed, in words

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first sample), as vLLM reports
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), once all are in.
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    pooled: Optional[list[float]] = None  # a pooling request's result (PoolingParams): an embedding or [score]


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """vLLM's shape for LLM.embed and LLM.score: `outputs.embedding` or `outputs.score`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput
    finished: bool = True
