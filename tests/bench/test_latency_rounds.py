"""bench latency --rounds: every variant and the peer run once per round; the report keeps medians."""

from __future__ import annotations

import pytest

from llmpipe.bench.latency import add_ratios, latency_table, merge_rounds


def round_of(ours: float, peer: float, ttft: float) -> list[dict]:
    return [{"variant": "gguf", "decode_128": ours, "ttft_s": ttft},
            {"variant": "llama.cpp", "peer": True, "decode_128": peer, "ttft_s": 2 * ttft}]


def test_rounds_give_median_rates_best_ttft_and_each_rounds_ratio_to_the_peer():
    merged = merge_rounds([round_of(80, 100, 1.5), round_of(60, 50, 1.2), round_of(90, 90, 1.4)], [128])
    ours, peer = merged
    assert ours["decode_128"] == 80 and peer["decode_128"] == 90
    assert ours["decode_128_rounds"] == [80, 60, 90]
    assert ours["ttft_s"] == 1.2 and peer["ttft_s"] == 2.4
    assert ours["decode_128_vs_llama_cpp_rounds"] == pytest.approx([0.8, 1.2, 1.0])
    assert "decode_128_vs_llama_cpp_rounds" not in peer


def test_one_round_is_reported_as_measured():
    only = round_of(80, 100, 1.5)
    assert merge_rounds([only], [128]) == only


def test_context_itls_are_medians_over_rounds_and_their_ratio_is_longest_over_shortest():
    rounds = [[{"variant": "gguf", "decode_128": 80, "itl_ms_at_128": a, "itl_ms_at_2048": b}]
              for a, b in ((4.0, 5.0), (3.0, 4.2), (5.0, 6.0))]
    report = {"results": merge_rounds(rounds, [128]), "output_lens": [128], "decode_contexts": [128, 2048],
              "prompt_len": 512, "memory_bandwidth_GBps": 30.0}
    add_ratios(report, 10**8)
    (ours,) = report["results"]
    assert ours["itl_ms_at_128"] == 4.0 and ours["itl_ms_at_2048"] == 5.0
    assert ours["itl_ms_at_2048_rounds"] == [5.0, 4.2, 6.0]
    assert ours["itl_longest_vs_shortest_context"] == pytest.approx(1.25)
    assert "decode ITL 4.00 ms at 128, 5.00 ms at 2048 (1.25x)" in latency_table(report)
