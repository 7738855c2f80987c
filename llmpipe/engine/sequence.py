"""The engine core's view of a request and its sequences (one per sample when n > 1): token ids,
KV blocks, status. Text, stop strings and timing live in the front end (`output_processor`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from llmpipe.kv_cache.kinds import BlockTable
from llmpipe.engine.core_messages import EngineCoreOutput, RawLogprob
from llmpipe.pooling_params import PoolingParams
from llmpipe.sampling_params import SamplingParams


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
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)  # prompt + output, grown in place (no copy per step)
    status: SequenceStatus = SequenceStatus.WAITING
    block_tables: list[BlockTable] = field(default_factory=list)  # one per KV cache group
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hashes of its full blocks
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, served by the prefix cache at admission
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    cache_salt: str | None = None  # seeds the prefix-cache hashes: its LoRA adapter, or the request's cache_salt
    lora_name: str | None = None  # the LoRA adapter its rows run under (None: the base model)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why it finished with "error"
    num_sent: int = 0  # output tokens already handed to the front end
    new_logprobs: list[RawLogprob] | None = None  # of the tokens not yet sent (when logprobs were asked)
    num_prompt_logprobs: int = 0  # prompt positions (from 1) whose logprobs were computed
    new_prompt_logprobs: list[RawLogprob] | None = None  # of those, the ones not yet sent
    # Sample 0 of an n > 1 request: the other samples, until they start from its prefilled prompt.
    siblings: list[Sequence] = field(default_factory=list, repr=False)
    pooling: PoolingParams | None = None  # a pooling request: it ends with its prompt, pooled
    pooled: list[float] | None = None

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
    def needs_prompt_logprobs(self) -> bool:
        """Sample 0 of a request asking prompt_logprobs, before all of them were computed."""
        return (self.index == 0 and self.params.prompt_logprobs is not None
                and self.num_prompt_logprobs < len(self.prompt_token_ids) - 1)

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """Of the positions start..end-1 computed this step, those whose logits give a prompt
        token's logprob not yet computed (position q's logits score prompt token q + 1)."""
        if not self.needs_prompt_logprobs:
            return range(0)
        return range(max(start, self.num_prompt_logprobs), min(end, len(self.prompt_token_ids) - 1))

    def add_prompt_logprobs(self, logprobs: list[RawLogprob]) -> None:
        self.num_prompt_logprobs += len(logprobs)
        self.new_prompt_logprobs = (self.new_prompt_logprobs or []) + logprobs

    @property
    def in_prefill(self) -> bool:
        """More than the newest token still lacks K/V (a prompt, or a resumed preempted sequence); any token,
        for a pooling request (it never decodes)."""
        return self.num_tokens - self.num_computed_tokens > (0 if self.pooling is not None else 1)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.status = SequenceStatus.FINISHED

    def fail(self, error: str) -> None:
        """End this sequence alone: one request's fault must not sink the batch it ran in."""
        self.finish_reason, self.error, self.status = "error", error, SequenceStatus.FINISHED

    def take_output(self, first_scheduled_time: float | None = None) -> EngineCoreOutput:
        """What it gained since the last call, and how it ended if it did."""
        new = self.output_token_ids[self.num_sent :]
        self.num_sent = len(self.output_token_ids)
        logprobs, self.new_logprobs = self.new_logprobs, [] if self.new_logprobs is not None else None
        prompt_logprobs, self.new_prompt_logprobs = self.new_prompt_logprobs, None
        return EngineCoreOutput(
            self.request_id, self.index, new, logprobs, self.finish_reason, self.stop_reason, self.error,
            self.num_cached_tokens, first_scheduled_time, prompt_logprobs, self.pooled,
        )


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Sequence]
    first_scheduled_time: float | None = None
    scheduled_sent: bool = False  # first_scheduled_time went out with an output

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)
