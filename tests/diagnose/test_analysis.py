"""The diagnosis logic on hand-made measurements: verdict, rates and levers, no timing involved."""

import pytest

from llmpipe.config import ModelConfig
from llmpipe.diagnose.analysis import diagnose
from llmpipe.diagnose.report import Limits, Setup, TimeSplit, Workload

# SmolLM2-135M's shape: 30 layers, 9 heads, 3 KV heads of 64, tied embeddings.
CFG = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  max_position_embeddings=8192, tie_word_embeddings=True)
WEIGHTS = 538_060_032  # 134,515,008 float32 parameters
KV = 2 * 30 * 3 * 64 * 4  # bytes per token
LIMITS = Limits(bandwidth=20e9, flops=400e9)


def setup(**kw) -> Setup:
    return Setup(config=CFG, dtype="float32", weight_bytes=WEIGHTS, kv_bytes_per_token=KV,
                 kv_capacity_tokens=1456 * 16, kv_peak_usage=0.01, prefix_caching=True, **kw)


def split(prefill: float, decode: float, tokens: int, queue: float = 0.0) -> TimeSplit:
    itl = decode / (tokens - 1) if tokens > 1 else None
    return TimeSplit(queue_s=queue, prefill_s=prefill, decode_s=decode, overhead_s=0.001, mean_itl_s=itl,
                     max_itl_s=itl, prefill_wall_s=prefill)


def test_long_output_is_decode_bound_with_bandwidth_share():
    # 128 tokens at 70 ms each after a 16-token prompt
    d = diagnose(Workload(16, 128, 1), split(0.05, 127 * 0.07, 128), setup(), LIMITS)
    step_bytes = WEIGHTS + KV * (16 + 128 / 2)  # weights + KV of the mean attended context
    assert d.rates.decode_bytes_per_token == step_bytes
    assert d.rates.bandwidth_fraction == pytest.approx(step_bytes / 0.07 / 20e9)
    share = 127 * 0.07 / (0.05 + 127 * 0.07 + 0.001)
    assert d.bound == "decode-bound"
    bandwidth_share = step_bytes / 0.07 / 20e9
    assert d.verdict == f"decode-bound: {share:.0%} of time in decode at {bandwidth_share:.0%} of memory bandwidth"
    latency = [lv for lv in d.levers if lv.metric == "request latency"]
    assert latency[0].name == "quantize weights"  # fewer bytes per step: the biggest latency lever here
    assert latency[0].gain > 3  # float32 → int4 reads ~1/7 of the bytes
    assert {"batch more", "speculative decoding", "int8 KV cache"} <= {lv.name for lv in d.levers}
    assert [lv.gain for lv in d.levers] == sorted((lv.gain for lv in d.levers), reverse=True)


def test_long_prompt_one_token_is_prefill_bound_and_levers_follow():
    prefill = 4.0
    d = diagnose(Workload(2048, 1, 1), split(prefill, 0.0, 1), setup(), LIMITS)
    assert d.bound == "prefill-bound"
    assert d.verdict.startswith("prefill-bound: 100% of time before the first token at ")
    assert d.verdict.endswith("% of peak matmul FLOP/s")
    names = [lv.name for lv in d.levers]
    assert names[0] == "prefix caching"
    assert not {"quantize weights", "batch more", "speculative decoding", "int8 KV cache"} & set(names)
    total = prefill + 0.001
    assert d.levers[0].gain == pytest.approx(total / (prefill * 16 / 2048 + 0.001))  # only the last block is computed


def test_verdict_flips_on_the_share_before_the_first_token():
    before = diagnose(Workload(512, 8, 1), split(1.0, 0.9, 8), setup(), LIMITS)
    after = diagnose(Workload(512, 8, 1), split(1.0, 1.1, 8), setup(), LIMITS)
    assert before.bound == "prefill-bound" and after.bound == "decode-bound"


def test_queueing_counts_toward_the_start_and_is_called_out():
    d = diagnose(Workload(64, 16, 8), split(0.2, 1.0, 16, queue=2.0), setup(), LIMITS)
    assert d.bound == "prefill-bound"
    assert any("queueing" in note for note in d.notes)


def test_prefill_rate_is_flops_over_prefill_time():
    from llmpipe.diagnose import costs

    d = diagnose(Workload(512, 1, 2), split(1.5, 0.0, 1), setup(), LIMITS)
    assert d.rates.prefill_flops == 2 * costs.prefill_flops(CFG, 512)
    assert d.rates.prefill_flops_per_s == pytest.approx(d.rates.prefill_flops / 1.5)
    assert d.rates.flops_fraction == pytest.approx(d.rates.prefill_flops_per_s / 400e9)


def test_batching_gain_stops_where_compute_catches_up():
    d = diagnose(Workload(16, 128, 1), split(0.05, 127 * 0.07, 128), setup(), LIMITS)
    batch = next(lv for lv in d.levers if lv.name == "batch more")
    # a step of b sequences costs at least b × 2 × 134.5M FLOP at prefill's measured rate
    assert batch.metric == "output tokens/s" and 1 < batch.gain <= 128


def test_kv_use_counts_whole_blocks_and_pool_capacity():
    d = diagnose(Workload(100, 28, 1), split(0.1, 1.0, 28), setup(), LIMITS)
    assert d.kv.context == 128
    assert d.kv.bytes_per_sequence == 128 * KV
    assert d.kv.capacity_sequences == 1456 * 16 // 128


def test_without_a_model_config_only_timing_levers_remain():
    d = diagnose(Workload(256, 64, 1), split(0.3, 3.0, 64))
    assert d.bound == "decode-bound" and "bandwidth" not in d.verdict
    assert d.rates is None and d.kv is None
    assert {lv.name for lv in d.levers} <= {"prefix caching", "speculative decoding", "shorter context"}
    assert d.levers[0].name == "speculative decoding"


def test_speculation_is_not_advised_when_verifying_costs_more_than_it_saves():
    # prefill ran at ~1 GFLOP/s: verifying 5 positions at once would take ~1.4 s against a 70 ms step
    d = diagnose(Workload(16, 128, 1), split(4.0, 127 * 0.07, 128), setup(), LIMITS)
    assert "speculative decoding" not in {lv.name for lv in d.levers}
    assert any(note.startswith("not expected to help here: speculative decoding (0.") for note in d.notes)
    assert all(lv.gain >= 1 for lv in d.levers)


def test_a_decode_step_far_below_both_roofs_is_called_overhead():
    # batch 32: 2 s per step for ~180 MB and ~9 GFLOP is 9% of 20 GB/s and 1% of 400 GFLOP/s
    d = diagnose(Workload(16, 64, 32), split(0.5, 63 * 2.0, 64), setup(), LIMITS)
    assert d.rates.decode_flops_per_s == d.rates.decode_step_flops / 2.0
    assert any(note.startswith("decode reaches neither roof") for note in d.notes)
    healthy = diagnose(Workload(16, 128, 1), split(0.05, 127 * 0.07, 128), setup(), LIMITS)
    assert not any(note.startswith("decode reaches neither roof") for note in healthy.notes)


def test_chunked_prefill_bounds_the_stall_a_long_prompt_causes():
    # a 1,024-token prompt prefilled in 2 s (one chunk under the 2,048-token budget) while streams decode at 70 ms
    d = diagnose(Workload(1024, 64, 1), split(2.0, 63 * 0.07, 64), setup(), LIMITS)
    lever = next(lv for lv in d.levers if lv.name == "chunked prefill")
    per_token = 2.0 / 1024
    assert lever.gain == pytest.approx((0.07 + 1024 * per_token) / (0.07 + 256 * per_token))
    assert lever.action == "--max-num-batched-tokens 256"
