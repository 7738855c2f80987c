"""`llmpipe bench serve` against a live server: counts agree with the server's own /metrics, the
arithmetic with hand-computed figures, and failures are counted, not raised."""

from __future__ import annotations

import asyncio
import json
import random
import statistics

import pytest

from llmpipe.bench.serve import RequestResult, poisson_arrivals, summarize
from llmpipe.cli import main
from tests.server.utils import metric

NUM, INPUT_LEN, OUTPUT_LEN = 6, 12, 5


def bench(url: str, tmp_path, *extra: str) -> dict:
    args = ["bench", "serve", "--base-url", url, "--num-prompts", str(NUM), "--input-len", str(INPUT_LEN),
            "--output-len", str(OUTPUT_LEN), "--vocab-size", "300", "--json", str(tmp_path / "serve.json"), *extra]
    assert main(args) == 0
    return json.loads((tmp_path / "serve.json").read_text())


def test_bench_counts_match_the_servers_metrics_and_draws_a_plot(url, tmp_path):
    before = [metric(url, f"llmpipe:{name}_tokens_total") for name in ("prompt", "generation")]
    report = bench(url, tmp_path, "--max-concurrency", "1", "4", "--request-rate", "50", "--plot", str(tmp_path / "s.png"))
    after = [metric(url, f"llmpipe:{name}_tokens_total") for name in ("prompt", "generation")]
    assert [run["max_concurrency"] for run in report["runs"]] == [1, 4]
    for run in report["runs"]:
        assert (run["completed"], run["failed"]) == (NUM, 0)
        assert run["total_input_tokens"] == NUM * INPUT_LEN and run["total_output_tokens"] == NUM * OUTPUT_LEN
        assert run["output_throughput"] == pytest.approx(NUM * OUTPUT_LEN / run["duration_s"])
        for name in ("ttft", "tpot", "itl", "e2e"):
            stats = run[name]
            assert 0 < stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"]
        assert run["ttft"]["mean_ms"] < run["e2e"]["mean_ms"]
    assert after[0] - before[0] == 2 * NUM * INPUT_LEN
    assert after[1] - before[1] == 2 * NUM * OUTPUT_LEN
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_server_counts_failures(tmp_path):
    report = bench("http://127.0.0.1:9", tmp_path, "--model", "m", "--timeout", "5")
    run = report["runs"][0]
    assert (run["completed"], run["failed"]) == (0, NUM)
    assert run["errors"] and run["ttft"]["mean_ms"] is None


def test_summary_arithmetic_by_hand():
    results = [
        RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestResult(ok=True, prompt_tokens=10, output_tokens=3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]),
        RequestResult(ok=False, error="HTTP 503"),
    ]
    s = summarize(results, duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 503"])
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.0 and s["total_token_throughput"] == 14.0
    assert s["ttft"]["mean_ms"] == pytest.approx(200) and s["ttft"]["p50_ms"] == pytest.approx(200)
    assert s["tpot"]["mean_ms"] == pytest.approx((100 + 200) / 2)  # (0.5-0.1)/4 and (0.7-0.3)/2
    assert s["itl"]["p50_ms"] == pytest.approx(100) and s["itl"]["p99_ms"] == pytest.approx(200)
    assert s["e2e"]["p90_ms"] == pytest.approx(500 + 0.9 * 200)


def test_poisson_arrival_gaps_average_one_over_the_rate():
    gaps = []

    async def record(seconds):  # passed in, not patched over asyncio.sleep: another thread's loop may sleep too
        gaps.append(seconds)

    async def drain(rate):
        return [i async for i in poisson_arrivals(4001, rate, random.Random(1), sleep=record)]

    assert asyncio.run(drain(20.0)) == list(range(4001))
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.07)  # exponential: stdev = mean
    gaps.clear()
    asyncio.run(drain(float("inf")))
    assert gaps == []


def test_the_llama_server_comparison_needs_a_gguf_and_concurrencies(tiny_checkpoint, capsys):
    """--peer llama.cpp runs the same file on both servers: a Hugging Face directory is refused in
    one line before anything starts, as is a run without --max-concurrency."""
    path = str(tiny_checkpoint("llama_gqa"))
    assert main(["bench", "serve", "--peer", "llama.cpp", "--model", path, "--max-concurrency", "1"]) != 0
    assert "is not one" in capsys.readouterr().err
    assert main(["bench", "serve", "--peer", "llama.cpp", "--model", path]) != 0
    assert "--max-concurrency" in capsys.readouterr().err


def test_peer_ratios_divide_ours_by_theirs():
    from llmpipe.bench.serve_peer import ratio_row

    def run(tput, ttft99, itl50, itl99, failed=0):
        return {"max_concurrency": 4, "output_throughput": tput, "ttft": {"p99_ms": ttft99},
                "itl": {"p50_ms": itl50, "p99_ms": itl99}, "failed": failed}

    row = ratio_row(run(90.0, 500.0, 20.0, 50.0), run(45.0, 2000.0, 10.0, 80.0))
    assert row == {"max_concurrency": 4, "output_throughput": 2.0, "ttft_p99": 0.25, "itl_p50": 2.0,
                   "itl_p99_over_p50": 2.5, "failed": 0}
