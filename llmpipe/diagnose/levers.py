"""The levers a diagnosis ranks, each with its effect estimated from the measurements.

Estimates assume what the measurements show stays true: decode runs at the bandwidth fraction it
reached (so its time scales with the bytes read per step); prefill and batched compute run at the
FLOP rate prefill reached.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmpipe.config import DTYPES
from llmpipe.diagnose import costs
from llmpipe.diagnose.memory import weight_bytes
from llmpipe.diagnose.report import KVUse, Lever, Rates, Setup, TimeSplit, Workload
from llmpipe.kv_cache.paged import kv_bytes_per_token

SPEC_ACCEPTANCE = 0.7  # assumed per-token acceptance of drafted tokens
SPEC_TOKENS = 4  # drafted tokens per verification step
CHUNK_TOKENS = 256  # the prefill chunk proposed for mixed load


def rank_levers(w: Workload, s: TimeSplit, setup: Setup | None, rates: Rates | None, kv: KVUse | None) -> list[Lever]:
    """The levers that apply, best estimated gain first."""
    m = _Model(w, s, setup, rates, kv)
    with_bytes = [_quantize, _int8_kv, _batch_more] if setup and rates and s.decode_s > 0 else []
    found = [f(m) for f in with_bytes] + [_prefix_cache(m), _speculative(m), _chunked_prefill(m), _shorter_context(m)]
    return sorted((lever for lever in found if lever), key=lambda lever: -lever.gain)


@dataclass
class _Model:
    """The measured quantities the estimates scale."""

    w: Workload
    s: TimeSplit
    setup: Setup | None
    rates: Rates | None
    kv: KVUse | None

    def latency_gain(self, prefill_s: float, decode_s: float) -> float:
        new = self.s.queue_s + prefill_s + decode_s + self.s.overhead_s
        return self.s.total_s / new if new > 0 else 1.0

    def decode_with(self, weight: float, kv_per_token: float, context: float | None = None) -> float:
        """Decode time if each step read these bytes instead (same fraction of bandwidth)."""
        setup, rates = self.setup, self.rates
        context = rates.decode_context if context is None else context
        new = costs.decode_step_bytes(setup.config, weight, kv_per_token, self.w.batch, context)
        return self.s.decode_s * new / rates.decode_step_bytes


def _quantize(m: _Model) -> Lever | None:
    setup = m.setup
    int4 = weight_bytes(setup.config, setup.dtype, "int4", setup.group_size).resident
    int8 = weight_bytes(setup.config, setup.dtype, "int8").resident
    if int4 >= 0.9 * setup.weight_bytes:
        return None  # already low-bit
    decode = m.decode_with(int4, setup.kv_bytes_per_token)
    action = "--quantization int4" + (" (or int8)" if int8 < 0.9 * setup.weight_bytes else "")
    return Lever(
        "quantize weights", action, "request latency", m.latency_gain(m.s.prefill_s, decode),
        f"weights {setup.weight_bytes / 1e6:,.0f} MB → {int4 / 1e6:,.0f} MB as int4 g{setup.group_size} "
        f"({int8 / 1e6:,.0f} MB as int8); decode {m.s.decode_s:.2f} s → {decode:.2f} s",
    )


def _int8_kv(m: _Model) -> Lever | None:
    setup = m.setup
    kv, kv8 = setup.kv_bytes_per_token, kv_bytes_per_token(setup.config, DTYPES[setup.dtype], "int8")
    if kv8 >= kv:
        return None
    decode = m.decode_with(setup.weight_bytes, kv8)
    return Lever(
        "int8 KV cache", "--kv-cache-dtype int8", "request latency", m.latency_gain(m.s.prefill_s, decode),
        f"KV {kv:,} → {kv8:,} B per token; decode {m.s.decode_s:.2f} s → {decode:.2f} s; the KV pool holds "
        f"{kv / kv8:.1f}x the sequences",
    )


def _batch_more(m: _Model) -> Lever | None:
    """Output tokens/s at a larger batch: a step reads the weights once for every sequence in it,
    until its FLOPs (at prefill's measured rate) outgrow the bytes."""
    setup, rates, w, s = m.setup, m.rates, m.w, m.s
    flop_rate = rates.prefill_flops_per_s
    capacity, kv = setup.max_num_seqs, m.kv
    if kv.capacity_sequences is not None:
        capacity = min(capacity, kv.capacity_sequences)
    if capacity <= w.batch or w.output_len <= 1 or not s.mean_itl_s or not flop_rate:
        return None
    bandwidth = rates.decode_step_bytes / s.mean_itl_s
    per_token_flops = rates.decode_step_flops / w.batch

    def step(b: int) -> tuple[float, float]:
        memory = costs.decode_step_bytes(setup.config, setup.weight_bytes, setup.kv_bytes_per_token, b,
                                         rates.decode_context) / bandwidth
        return memory, b * per_token_flops / flop_rate

    def throughput(b: int) -> float:
        return b * w.output_len / (s.prefill_wall_s * b / w.batch + (w.output_len - 1) * max(step(b)))

    rates_by_b = {b: throughput(b) for b in range(w.batch, capacity + 1)}
    best = max(rates_by_b.values())
    b = min(b for b, r in rates_by_b.items() if r >= 0.95 * best)
    memory, compute = step(b)
    limit = "compute" if compute > memory else "memory"
    return Lever(
        "batch more", f"run {b} requests at once (--max-num-seqs ≥ {b})", "output tokens/s",
        rates_by_b[b] / rates_by_b[w.batch],
        f"a decode step of {b} sequences takes ~{max(memory, compute) * 1e3:.0f} ms ({limit}-limited; compute "
        f"taken at prefill's {flop_rate / 1e9:.1f} GFLOP/s) vs {s.mean_itl_s * 1e3:.0f} ms for {w.batch}; the KV "
        f"cache holds {capacity} sequences of {kv.context} tokens",
    )


def _prefix_cache(m: _Model) -> Lever | None:
    s, w = m.s, m.w
    block = m.setup.block_size if m.setup else 16
    if s.prefill_s <= 0 or w.prompt_len <= block:
        return None
    prefill = s.prefill_s * block / w.prompt_len  # only the last block's tokens left to compute
    on = m.setup is not None and m.setup.prefix_caching
    action = "(on) put the shared part of prompts first" if on else "--enable-prefix-caching"
    return Lever(
        "prefix caching", action, "request latency", m.latency_gain(prefill, s.decode_s),
        f"up to: TTFT prefill {s.prefill_s:.2f} s → {prefill:.3f} s when all but the last {block} prompt tokens "
        "were seen before (system prompt, few-shot examples, documents); in proportion to the shared part",
    )


def _speculative(m: _Model) -> Lever | None:
    s, w = m.s, m.w
    if w.output_len <= 1 or not s.mean_itl_s or s.decode_s <= 0:
        return None
    a, k = SPEC_ACCEPTANCE, SPEC_TOKENS
    per_verify = (1 - a ** (k + 1)) / (1 - a)  # expected tokens per verification step
    verify = s.mean_itl_s
    if m.rates and m.rates.prefill_flops_per_s:  # k + 1 positions: more FLOPs per step, same bytes
        verify = max(verify, (k + 1) * m.rates.decode_step_flops / m.rates.prefill_flops_per_s)
    decode = s.decode_s * verify / (per_verify * s.mean_itl_s)
    return Lever(
        "speculative decoding", f"--speculative-method ngram --num-speculative-tokens {k}", "request latency",
        m.latency_gain(s.prefill_s, decode),
        f"assuming {a:.0%} of {k} drafted tokens accepted (n-gram drafts, free to propose): {per_verify:.1f} tokens "
        f"per {verify * 1e3:.0f} ms verify step vs 1 per {s.mean_itl_s * 1e3:.0f} ms; decode {s.decode_s:.2f} s → "
        f"{decode:.2f} s",
    )


def _chunked_prefill(m: _Model) -> Lever | None:
    """How long running streams stall while a prompt like this one is prefilled."""
    s, w = m.s, m.w
    budget = m.setup.max_num_batched_tokens if m.setup else w.prompt_len
    chunk = min(w.prompt_len, budget)
    if chunk <= CHUNK_TOKENS or not s.mean_itl_s:
        return None
    per_token = s.prefill_wall_s / (w.batch * w.prompt_len)
    now, new = s.mean_itl_s + chunk * per_token, s.mean_itl_s + CHUNK_TOKENS * per_token
    return Lever(
        "chunked prefill", f"--max-num-batched-tokens {CHUNK_TOKENS}", "worst ITL while a prompt arrives", now / new,
        f"a {w.prompt_len}-token prompt arriving mid-stream stalls other streams' next token ~{now * 1e3:.0f} ms; "
        f"{CHUNK_TOKENS}-token chunks bound it to ~{new * 1e3:.0f} ms (TTFT of the long prompt grows slightly)",
    )


def _shorter_context(m: _Model) -> Lever | None:
    s, w, setup = m.s, m.w, m.setup
    half = w.prompt_len // 2
    if half < 16:
        return None
    if setup and m.rates:
        cfg = setup.config
        prefill = s.prefill_s * costs.prefill_flops(cfg, half) / costs.prefill_flops(cfg, w.prompt_len)
        context = costs.mean_decode_context(half, w.output_len)
        decode = m.decode_with(setup.weight_bytes, setup.kv_bytes_per_token, context) if s.decode_s > 0 else 0.0
    else:
        prefill, decode = s.prefill_s * half / w.prompt_len, s.decode_s
    return Lever(
        "shorter context", f"trim prompts to ~{half} tokens (retrieval, summarised history)", "request latency",
        m.latency_gain(prefill, decode),
        f"half the prompt: prefill {s.prefill_s:.2f} s → {prefill:.2f} s"
        + (f", decode {s.decode_s:.2f} s → {decode:.2f} s" if s.decode_s > 0 else "")
        + "; the KV cache then holds more sequences",
    )
