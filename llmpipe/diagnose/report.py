"""What a diagnosis is made of: the probe's measurements, this machine's limits, and the findings."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmpipe.config import ModelConfig
from llmpipe.engine.step_size import STEP_TOKENS


@dataclass
class Workload:
    prompt_len: int
    output_len: float  # mean generated tokens per request
    batch: int  # requests run at once


@dataclass
class TimeSplit:
    """Mean seconds per request. TTFT = queue + prefill; decode = first token → last token."""

    queue_s: float
    prefill_s: float
    decode_s: float
    overhead_s: float  # detokenizing (local) or HTTP + streaming (remote), outside the model's steps
    mean_itl_s: float | None
    max_itl_s: float | None
    prefill_wall_s: float  # first prompt scheduled → last first token, the whole batch

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s

    @property
    def total_s(self) -> float:
        return self.queue_s + self.prefill_s + self.decode_s + self.overhead_s

    def fractions(self) -> dict[str, float]:
        total = self.total_s or 1.0
        return {k: getattr(self, f"{k}_s") / total for k in ("queue", "prefill", "decode", "overhead")}


@dataclass
class Limits:
    """This machine's ceilings, measured on the spot."""

    bandwidth: float  # bytes/s of a streaming read
    flops: float  # matmul FLOP/s


@dataclass
class Setup:
    """The model and engine the probe ran."""

    config: ModelConfig
    dtype: str
    weight_bytes: int  # resident weights, all read once per decode step
    kv_bytes_per_token: int
    kv_capacity_tokens: int | None = None  # KV pool: blocks × block size
    kv_peak_usage: float | None = None  # fraction of blocks in use at the peak of the run
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = STEP_TOKENS  # the engine's step budget (engine/step_size)
    prefix_caching: bool | None = None
    group_size: int = 128


@dataclass
class Rates:
    decode_context: float  # positions attended per decode step, mean
    decode_step_bytes: float  # weights + every sequence's KV read
    decode_step_flops: float
    decode_bytes_per_token: float  # per decoded token: step bytes / batch
    decode_bytes_per_s: float | None
    bandwidth_fraction: float | None
    decode_flops_per_s: float | None
    decode_flops_fraction: float | None  # of peak matmul FLOP/s
    prefill_flops: float  # the whole batch's prompts
    prefill_bytes: float  # weights once per chunk + the K/V written
    prefill_flops_per_s: float | None
    flops_fraction: float | None


@dataclass
class KVUse:
    bytes_per_token: int
    context: int  # prompt + output
    bytes_per_sequence: int  # whole blocks
    capacity_sequences: int | None  # sequences of this context the pool holds at once
    peak_usage: float | None


@dataclass
class Lever:
    name: str
    action: str
    metric: str  # what `gain` multiplies
    gain: float  # estimated factor, > 1 is better
    detail: str


@dataclass
class Diagnosis:
    workload: Workload
    split: TimeSplit
    bound: str  # "prefill-bound" | "decode-bound"
    verdict: str
    levers: list[Lever]
    limits: Limits | None = None
    rates: Rates | None = None
    kv: KVUse | None = None
    notes: list[str] = field(default_factory=list)
