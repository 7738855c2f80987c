"""`llmpipe serve --data-parallel-size 2` on a real local Ray cluster: two engine replicas of a tiny random
checkpoint on Ray Serve behind one OpenAI ingress. The same greedy tokens as one engine, 64 concurrent
streams without a failure, conversations kept on the replica holding their prefix, per-replica /metrics,
and a replica killed mid-run: its requests fail cleanly, the other carries on, and it rejoins.

Waits poll a condition under a deadline that only guards against a hang; the engines are paced
(every step lasts ≥ 10 ms), so a long request is still running when the replica is killed."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

ray = pytest.importorskip("ray")

from llmpipe import SamplingParams  # noqa: E402
from llmpipe.deploy.client import DataParallelCoreClient  # noqa: E402
from llmpipe.deploy.ray import serve_options, start_replicas, stop_replicas  # noqa: E402
from llmpipe.deploy.replica import info_decoder  # noqa: E402
from llmpipe.deploy.router import make_router  # noqa: E402
from llmpipe.loader import load_checkpoint  # noqa: E402
from llmpipe.server.async_engine import AsyncEngine  # noqa: E402
from tests.server.utils import free_port, live_server, paced, wait_until as server_wait_until  # noqa: E402

HANG_GUARD_S = 180.0
# Ray Serve's replacement of a killed replica on a loaded 2-core CI machine: a Ray worker process to
# schedule, then the replica's constructor (its engine core process importing torch and loading):
# 216 s once (60 s + 144 s) beside the other test worker, against 13 s for the first replicas.
REJOIN_GUARD_S = 600.0
BLOCK = 16
# Serve's controller kills a proxy not ready in 5 s (its first start; more for each restart) and starts
# another, but serve.start waits on the first: under load every test here errored at setup with
# ActorDiedError. Generous readiness and health timeouts, and serve.start tried again if it still dies.
# Ray's workers at nice 0, as llmpipe.deploy.ray starts them (at Ray's default nice 15 a busy machine starves them).
RAY_ENVIRONMENT = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
                  "RAY_worker_niceness": "0"}
PROXY_START_TRIES = 3


DEPLOY_GUARD_S = 900.0  # a hang guard for Serve's deploy: measured up to ~4 min beside two busy loops


def wait_until(condition, what: str, timeout: float = HANG_GUARD_S) -> None:
    server_wait_until(condition, what, timeout)


@pytest.fixture(scope="module")
def cluster(tiny_path):
    """(base URL, the ingress's client over the replicas, Serve's proxy URL)."""
    from ray import serve

    # Logical CPUs: the CLI-style replicas, then the Serve application's two and its ingress. The local
    # cluster's processes take this process's environment: Serve's controller reads its timeouts there.
    with pytest.MonkeyPatch.context() as env:
        for name, value in RAY_ENVIRONMENT.items():
            env.setenv(name, value)
        ray.init(num_cpus=8, include_dashboard=False, logging_level="error", log_to_driver=False,
                 object_store_memory=80 * 2**20)
    port = free_port()
    options = serve_options({"model": tiny_path, "data_parallel_size": 2, "num_threads": 1, "max_num_blocks": 512})
    handles = []
    try:
        start_serve(serve, http_options={"host": "127.0.0.1", "port": port})  # Serve's proxy: for the Serve application's test
        handles = start_replicas(options, paced(0.01))
        client = DataParallelCoreClient.connect(handles, make_router("prefix", BLOCK))
        with live_server(AsyncEngine(client, load_checkpoint(tiny_path).tokenizer, 512)) as url:
            yield url, client, f"http://127.0.0.1:{port}"
    finally:
        stop_replicas(handles)


def start_serve(serve, **options) -> None:
    """serve.start, after a shutdown again, while its proxy dies starting up (a bounded number of tries)."""
    for attempt in range(1, PROXY_START_TRIES + 1):
        try:
            serve.start(**options)
            return
        except (ray.exceptions.RayActorError, TimeoutError):
            if attempt == PROXY_START_TRIES:
                raise
            serve.shutdown()


def complete(url: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S)


def stream(url: str, prompt: list[int], max_tokens: int, first_token=None) -> tuple[int, str | None]:
    """Tokens streamed (the usage chunk's count), and the error event's message if one came; calls
    first_token() at the first chunk."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    texts, error, tokens = [], None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                continue
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if not event["choices"]:
                continue
            texts.append(event["choices"][0]["text"])
            if first_token is not None and len(texts) == 1:
                first_token()
    return tokens, error


def prompts(count: int, length: int = 2 * BLOCK + 3) -> list[list[int]]:
    return [[1] + [(7 * i + 3 * j) % 300 + 2 for j in range(length)] for i in range(count)]


def per_replica(url: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    family = next(f for f in families if f.name == name.removesuffix("_total"))
    return {s.labels["replica"]: s.value for s in family.samples}


def test_greedy_tokens_through_two_replicas_equal_one_engines_and_both_replicas_serve(cluster, tiny_llm):
    url, _, _ = cluster
    batch = prompts(32)
    want = [o.outputs[0].text for o in tiny_llm.generate(
        [{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))]
    before = per_replica(url, "llmpipe:prefix_cache_queries")
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: complete(url, p, 8), batch))
    assert [r.status_code for r in replies] == [200] * 32
    assert [r.json()["choices"][0]["text"] for r in replies] == want
    after = per_replica(url, "llmpipe:prefix_cache_queries")
    assert sorted(after) == ["0", "1"] and all(after[r] > before.get(r, 0) for r in after)


def test_64_concurrent_streams_finish_without_a_failure(cluster):
    url, _, _ = cluster
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda p: stream(url, p, 12), prompts(64, BLOCK)))
    assert [error for _, error in results] == [None] * 64
    assert [tokens for tokens, _ in results] == [12] * 64


def test_each_turn_of_a_conversation_returns_to_the_replica_holding_its_prefix(cluster):
    url, client, _ = cluster
    conversations = prompts(2, 4 * BLOCK)
    hits = per_replica(url, "llmpipe:prefix_cache_hits")
    for turn in range(3):
        for c, conversation in enumerate(conversations):
            reply = complete(url, conversation, 4)
            assert reply.status_code == 200
            conversations[c] = conversation + [5 + turn] * BLOCK  # the next turn resends all of it
    gained = sum(v - hits.get(r, 0) for r, v in per_replica(url, "llmpipe:prefix_cache_hits").items())
    # Turns 2 and 3 of both conversations find at least their first 4 blocks cached where they go.
    assert gained >= 2 * 2 * 4
    assert client.router.capacity == 2 * 512  # the router remembers what the replicas' caches hold


def test_a_killed_replica_fails_its_requests_the_other_carries_on_and_it_rejoins(cluster):
    url, client, _ = cluster
    pids = [info_decoder.decode(h.info.remote().result()).pid for h in client.handles]
    started: list[int] = []
    long = prompts(6, BLOCK)
    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(stream, url, p, 200, lambda: started.append(1)) for p in long]
        wait_until(lambda: len(started) == len(long), "every stream's first token")
        on_victim = client._loads[0]
        assert on_victim > 0 and client._loads[1] > 0
        os.kill(pids[0], signal.SIGKILL)
        wait_until(lambda: not client._up[0], "the ingress noticing the dead replica")
        fresh = complete(url, prompts(1, BLOCK)[0], 4)  # at once, on the replica that is up
        assert fresh.status_code == 200
        results = [f.result(timeout=HANG_GUARD_S) for f in running]
    failed = [error for _, error in results if error is not None]
    assert len(failed) == on_victim and all("replica 0 died" in e for e in failed)
    assert all(tokens == 200 for tokens, error in results if error is None)
    wait_until(lambda: client._up[0] and client.replica_stats[0] is not None, "replica 0 rejoining", REJOIN_GUARD_S)
    assert info_decoder.decode(client.handles[0].info.remote().result()).pid != pids[0]
    assert complete(url, prompts(1, BLOCK)[0], 4).status_code == 200


def test_the_ray_serve_application_serves_the_same_api_behind_serves_proxy(cluster, tiny_path, tiny_llm):
    from ray import serve

    _, _, url = cluster
    from llmpipe.deploy.ray import build_app

    app = build_app({"model": tiny_path, "data_parallel_size": 2, "num_threads": 1, "max_num_blocks": 256,
                     "api_key": "secret", "served_model_name": "tiny"})
    serve.run_many([serve.RunTarget(app, name="llmpipe", route_prefix="/")], wait_for_applications_running=False)
    # Two replicas and the ingress load on a busy 2-core machine: wait for Serve's verdict, whichever it is.
    wait_until(lambda: serve.status().applications["llmpipe"].status not in ("NOT_STARTED", "DEPLOYING"),
               "the Serve application deployed", DEPLOY_GUARD_S)
    status = serve.status().applications["llmpipe"]
    assert status.status == "RUNNING", status
    body = {"model": "tiny", "prompt": prompts(1)[0], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S).status_code == 401
    auth = {"Authorization": "Bearer secret"}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=HANG_GUARD_S)
    want = tiny_llm.generate([{"prompt_token_ids": prompts(1)[0]}],
                             SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == want
    assert 'replica="1"' in httpx.get(f"{url}/metrics", headers=auth).text
    serve.delete("llmpipe")
