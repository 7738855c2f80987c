"""Diagnosis of a probe run: where the time went, how close each phase came to this machine's limits,
and the verdict (prefill-bound or decode-bound), with the levers ranked by estimated gain.

Pure functions of the measurements: the verdict logic is testable without timing anything.
"""

from __future__ import annotations

from llmpipe.diagnose import costs
from llmpipe.diagnose.levers import rank_levers
from llmpipe.diagnose.memory import blocks_per_sequence
from llmpipe.diagnose.report import Diagnosis, KVUse, Limits, Rates, Setup, TimeSplit, Workload

MIN_GAIN = 1.0  # levers estimated to make things slower go to the notes
OFF_ROOF = 0.25  # a phase under this share of both roofs is dominated by per-step overhead


def diagnose(workload: Workload, split: TimeSplit, setup: Setup | None = None,
             limits: Limits | None = None) -> Diagnosis:
    rates = compute_rates(workload, split, setup, limits) if setup else None
    kv = kv_use(workload, setup) if setup else None
    bound, verdict = judge(split, rates)
    ranked = rank_levers(workload, split, setup, rates, kv)
    levers = [lever for lever in ranked if lever.gain >= MIN_GAIN]
    notes = [f"not expected to help here: {lv.name} ({lv.gain:.2f}x: {lv.detail})"
             for lv in ranked if lv.gain < MIN_GAIN]
    if split.queue_s > split.prefill_s and bound == "prefill-bound":
        notes.append("most of TTFT is queueing: requests wait for a free slot (raise max_num_seqs or KV memory)")
    if bound == "decode-bound" and rates and _off_roof(rates.bandwidth_fraction, rates.decode_flops_fraction):
        notes.append(f"decode reaches neither roof ({rates.bandwidth_fraction:.0%} of bandwidth, "
                     f"{rates.decode_flops_fraction:.0%} of matmul peak): per-step overhead (kernel choice, "
                     "dequantizing, Python) dominates a step; the estimates above assume time follows bytes")
    return Diagnosis(workload, split, bound, verdict, levers, limits, rates, kv, notes)


def judge(split: TimeSplit, rates: Rates | None) -> tuple[str, str]:
    """prefill-bound when more time passes before the first token than after it."""
    frac = split.fractions()
    if split.ttft_s >= split.decode_s:
        verdict = f"prefill-bound: {frac['queue'] + frac['prefill']:.0%} of time before the first token"
        if rates and rates.flops_fraction is not None:
            verdict += f" at {rates.flops_fraction:.0%} of peak matmul FLOP/s"
        return "prefill-bound", verdict
    verdict = f"decode-bound: {frac['decode']:.0%} of time in decode"
    if rates and rates.bandwidth_fraction is not None:
        verdict += f" at {rates.bandwidth_fraction:.0%} of memory bandwidth"
    return "decode-bound", verdict


def compute_rates(workload: Workload, split: TimeSplit, setup: Setup, limits: Limits | None) -> Rates:
    cfg, batch = setup.config, workload.batch
    context = costs.mean_decode_context(workload.prompt_len, workload.output_len)
    step_bytes = costs.decode_step_bytes(cfg, setup.weight_bytes, setup.kv_bytes_per_token, batch, context)
    itl = split.mean_itl_s
    bandwidth = step_bytes / itl if itl else None
    step_flops = batch * costs.decode_flops(cfg, context)
    prompt_tokens = batch * workload.prompt_len
    flops = batch * costs.prefill_flops(cfg, workload.prompt_len)
    flop_rate = flops / split.prefill_wall_s if split.prefill_wall_s > 0 else None
    return Rates(
        decode_context=context,
        decode_step_bytes=step_bytes,
        decode_step_flops=step_flops,
        decode_bytes_per_token=step_bytes / batch,
        decode_bytes_per_s=bandwidth,
        bandwidth_fraction=bandwidth / limits.bandwidth if bandwidth and limits else None,
        decode_flops_per_s=step_flops / itl if itl else None,
        decode_flops_fraction=step_flops / itl / limits.flops if itl and limits else None,
        prefill_flops=flops,
        prefill_bytes=costs.prefill_bytes(setup.weight_bytes, setup.kv_bytes_per_token, prompt_tokens,
                                          setup.max_num_batched_tokens),
        prefill_flops_per_s=flop_rate,
        flops_fraction=flop_rate / limits.flops if flop_rate and limits else None,
    )


def _off_roof(*fractions: float | None) -> bool:
    return all(f is not None and f < OFF_ROOF for f in fractions)


def kv_use(workload: Workload, setup: Setup) -> KVUse:
    context = workload.prompt_len + round(workload.output_len)
    blocks = blocks_per_sequence(context, setup.block_size)
    capacity = None
    if setup.kv_capacity_tokens is not None:
        capacity = setup.kv_capacity_tokens // (blocks * setup.block_size)
    return KVUse(setup.kv_bytes_per_token, context, blocks * setup.block_size * setup.kv_bytes_per_token,
                 capacity, setup.kv_peak_usage)
