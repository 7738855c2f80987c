"""What crosses between a front end (LLM, the API server) and the engine core: token ids, never text.

msgspec structs, so the same objects travel in-process (the offline LLM, a thread) and as
msgpack over ZeroMQ (the API server ↔ the engine core process) with typed decoding.
"""

from __future__ import annotations

import msgspec

from llmpipe.sampling_params import SamplingParams

# A sampled token's logprob, its rank (1 = most likely) and the top-n (token id, logprob) pairs.
RawLogprob = tuple[float, int, list[tuple[int, float]]]


class EngineCoreRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sample's progress in a step: the tokens it gained and, once it ended, why."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[RawLogprob] | None = None
    finish_reason: str | None = None  # "stop" (EOS or a stop token) | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id that ended it, or GRAMMAR_END
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    first_scheduled_time: float | None = None  # set on the request's first output after scheduling
    # Sample 0 of a request asking prompt_logprobs: those of the prompt positions computed since the
    # last output, in order from position 1 (position 0 has none).
    new_prompt_logprobs: list[RawLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """One step's outputs (a step that raised lists every request in flight, ended with an error)."""

    outputs: list[EngineCoreOutput]
    timestamp: float  # time.perf_counter() when the step's tokens were sampled


class Abort(msgspec.Struct, array_like=True):
    """Stop these requests (index None: every sample; else that sample alone)."""

    targets: list[tuple[str, int | None]]
