"""What crosses between a front end (LLM, the API server) and the engine core: token ids, never text.

msgspec structs, so the same objects travel in-process (the offline LLM, a thread) and as
msgpack over ZeroMQ (the API server ↔ the engine core process) with typed decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from llmpipe.kv_cache.offload_tier import TierStats
from llmpipe.pooling_params import PoolingParams
from llmpipe.sampling_params import SamplingParams

# A sampled token's logprob, its rank (1 = most likely) and the top-n (token id, logprob) pairs.
RawLogprob = tuple[float, int, list[tuple[int, float]]]


class EngineCoreRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    pooling: PoolingParams | None = None  # a pooling request: no tokens, its pooled vector once the prompt is computed
    cache_salt: str | None = None  # its prefix-cache blocks are shared only with requests of the same salt
    lora_name: str | None = None  # the LoRA adapter it runs under (None: the base model)


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
    pooled: list[float] | None = None  # a pooling request's result (PoolingParams), with its finish

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


class LoRACommand(msgspec.Struct, array_like=True):
    """Load ("load", name, path) or unload ("unload", name) a LoRA adapter, between two steps; the core
    answers with the CommandResult of the same command_id."""

    command_id: int
    action: str
    name: str
    path: str | None = None


class CommandResult(msgspec.Struct, array_like=True):
    command_id: int
    status: int = 200  # as HTTP: 400 a bad adapter or request, 404 no adapter of that name
    error: str | None = None
    loras: dict[str, str] = {}  # the adapters loaded after the command: name → path


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
    kv_offload: TierStats | None = None  # with a prefix-cache tier below the pool: blocks saved, served, rejected


@dataclass(frozen=True)
class CoreInfo:
    """What a front end needs to know of the core it talks to: limits and ids for admission."""

    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    weight_bytes: int
    pid: int
    task: str = "generate"  # EngineConfig.task, resolved: "generate" (and embed), "embed" or "score"
    embedding_size: int | None = None  # the width of its embeddings (None: it embeds nothing)
    generates: bool = True  # False: an encoder, which pools only
    loras: dict[str, str] | None = None  # LoRA adapters loaded (name → path); None: LoRA is off
