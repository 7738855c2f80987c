"""What the executor hands the scheduler for a computed batch: plain data, keyed by sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmpipe.engine.core_messages import RawLogprob
from llmpipe.engine.sequence import Sequence


@dataclass
class SampledTokens:
    token_ids: list[int]
    logprobs: list[RawLogprob | None]  # one per token (None where the request asked none)


@dataclass
class ModelOutput:
    """What one batch produced, keyed by sequence, in the order the sequences sampled."""

    sampled: dict[Sequence, SampledTokens] = field(default_factory=dict)
    prompt_logprobs: dict[Sequence, list[RawLogprob]] = field(default_factory=dict)
    failed: dict[Sequence, str] = field(default_factory=dict)  # the sequence's own fault → its error
    pooled: dict[Sequence, list[float]] = field(default_factory=dict)  # pooling requests whose prompts completed
    # Requests whose prompt logprobs failed: each fails whole (its other samples would start from this one's blocks).
    failed_requests: dict[str, str] = field(default_factory=dict)
