"""/metrics: vLLM's names under llmpipe:, and counts that add up to what the responses said."""

from __future__ import annotations

import httpx

from llmpipe import LLM
from tests.server.utils import live_server, metric, paced

NAMES = [
    "llmpipe:time_to_first_token_seconds_bucket",
    "llmpipe:inter_token_latency_seconds_bucket",
    "llmpipe:e2e_request_latency_seconds_bucket",
    "llmpipe:request_queue_time_seconds_bucket",
    "llmpipe:prompt_tokens_total",
    "llmpipe:generation_tokens_total",
    'llmpipe:request_success_total{finished_reason="length"}',
    "llmpipe:num_preemptions_total",
    "llmpipe:num_requests_running",
    "llmpipe:num_requests_waiting",
    "llmpipe:kv_cache_usage_perc",
    "llmpipe:prefix_cache_queries_total",
    "llmpipe:prefix_cache_hits_total",
]
COUNTED = [
    "llmpipe:prompt_tokens_total",
    "llmpipe:generation_tokens_total",
    'llmpipe:request_success_total{finished_reason="length"}',
    'llmpipe:request_success_total{finished_reason="stop"}',
    "llmpipe:time_to_first_token_seconds_count",
    "llmpipe:inter_token_latency_seconds_count",
    "llmpipe:e2e_request_latency_seconds_count",
    "llmpipe:request_queue_time_seconds_count",
    "llmpipe:prefix_cache_hits_total",
]


def snapshot(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {name: metric(url, name) if name in text else 0.0 for name in COUNTED}


def complete(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"temperature": 0.0, "ignore_eos": True, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_every_metric_name_is_exported(tiny_url):
    complete(tiny_url, prompt="the quick", max_tokens=2)
    text = httpx.get(f"{tiny_url}/metrics").text
    assert httpx.get(f"{tiny_url}/metrics").headers["content-type"].startswith("text/plain")
    for name in NAMES:
        assert f"\n{name}" in text, name


def test_counters_add_up_to_the_responses(tiny_url):
    before = snapshot(tiny_url)
    prompt = [1] + list(range(200, 239))  # 40 tokens: 2 full 16-token blocks to reuse
    outs = [complete(tiny_url, prompt=prompt, max_tokens=m) for m in (5, 9)]
    stop_text = complete(tiny_url, prompt=prompt, max_tokens=9)["choices"][0]["text"]
    stopped = complete(tiny_url, prompt=prompt, max_tokens=9, stop=[stop_text[-2:]])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    outs += [stopped]
    after = snapshot(tiny_url)
    delta = {name: after[name] - before[name] for name in COUNTED}
    usage = [o["usage"] for o in outs] + [{"prompt_tokens": 40, "completion_tokens": 9}]
    assert delta["llmpipe:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usage) == 4 * 40
    assert delta["llmpipe:generation_tokens_total"] == sum(u["completion_tokens"] for u in usage)
    assert delta['llmpipe:request_success_total{finished_reason="length"}'] == 3
    assert delta['llmpipe:request_success_total{finished_reason="stop"}'] == 1
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta[f"llmpipe:{histogram}_seconds_count"] == 4
    gaps = sum(u["completion_tokens"] - 1 for u in usage)
    assert delta["llmpipe:inter_token_latency_seconds_count"] == gaps
    assert delta["llmpipe:prefix_cache_hits_total"] == 3 * 2  # requests 2-4 reuse both full blocks


def test_kv_usage_is_nonzero_while_a_request_runs(tiny_path):
    body = {"prompt": [1, 2, 3], "max_tokens": 300, "ignore_eos": True, "stream": True}
    # its own engine (the module's server steps tiny_llm's), paced: 300 tokens take 15 s
    with live_server(LLM(tiny_path, progress=False), before_step=paced()) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the stream, aborting the request
            next(lines)
            assert metric(url, "llmpipe:kv_cache_usage_perc") > 0
            assert metric(url, "llmpipe:num_requests_running") == 1


def test_offload_tier_counters_count_the_blocks_saved_and_restored(tiny_path):
    llm = LLM(tiny_path, progress=False, max_num_blocks=16, kv_offload_memory="16MiB")
    with live_server(llm) as url:
        assert "llmpipe:kv_offload_saved_blocks" in httpx.get(f"{url}/metrics").text
        prompt = list(range(3, 100))  # 6 full blocks
        complete(url, prompt=prompt, max_tokens=2)
        complete(url, prompt=[7] * 240, max_tokens=2)  # takes every block: the first prompt's are evicted
        assert complete(url, prompt=prompt, max_tokens=2)["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        assert metric(url, "llmpipe:kv_offload_restored_blocks_total") == 6
        assert metric(url, "llmpipe:kv_offload_saved_blocks_total") == 6 + 15
