"""`llmpipe serve`'s engine core in its own process: the same tokens as transformers over HTTP, many
streams and disconnects, and its faults — the core killed (errors, 503, the server exits 1), the API
server killed (the core exits), a load failure (one readable line).

Waits poll a condition back to back (each poll is an HTTP round trip) under a generous deadline
that only guards against a hang."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import httpx
import psutil
import pytest
import torch
import transformers

from tests.server.utils import core_process_engine, free_port, live_server, metric, paced, serve_process, wait_until
from tests.server.references import assert_greedy_matches, hf_greedy

HANG_GUARD_S = 120.0
PROMPTS = [[1, 5, 9, 13], [1, 200, 17], [1, 42, 43, 44, 45, 46, 47], [1, 300]]
STEPS = 24


def core_of(server_pid: int) -> psutil.Process:
    """The engine core: the server's multiprocessing child that is not its resource tracker (it is
    running once the server answers: the server waits for the loaded core before it listens)."""
    children = psutil.Process(server_pid).children()
    return next(c for c in children if "spawn_main" in " ".join(c.cmdline()))


def completion(url: str, prompt: list[int], max_tokens: int, stream: bool = False):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def process_url(tiny_path):
    with live_server(core_process_engine(tiny_path)) as url:
        yield url


def test_served_greedy_tokens_equal_transformers(process_url, tiny_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    results: dict[int, list[int]] = {}

    def call(i: int) -> None:  # all at once: one batch in the core
        body = {"prompt": PROMPTS[i], "max_tokens": STEPS, "temperature": 0.0, "ignore_eos": True,
                "return_tokens_as_token_ids": True, "logprobs": 1}
        reply = httpx.post(f"{process_url}/v1/completions", json=body, timeout=HANG_GUARD_S).json()
        results[i] = [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(PROMPTS):
        assert_greedy_matches(results[i], hf_greedy(model, prompt, STEPS))


def test_64_streams_at_once_all_finish_and_20_disconnects_free_every_block(tiny_path):
    with live_server(core_process_engine(tiny_path, before_step=paced(), max_num_seqs=64)) as url:
        done: list[int] = []

        def stream_all() -> None:
            with completion_stream(url, [1, 7, 8], 8) as response:
                done.append(sum(1 for line in response.iter_lines() if line.startswith("data: {")))

        threads = [threading.Thread(target=stream_all) for _ in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(done) == 64 and all(n >= 1 for n in done)

        def drop() -> None:
            with completion_stream(url, [1, 9, 10], 900) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        return  # hang up after the first token

        droppers = [threading.Thread(target=drop) for _ in range(20)]
        for t in droppers:
            t.start()
        for t in droppers:
            t.join()
        wait_until(lambda: metric(url, "llmpipe:kv_cache_usage_perc") == 0.0, "KV usage back to 0")
        assert metric(url, "llmpipe:num_requests_running") == 0


def completion_stream(url: str, prompt: list[int], max_tokens: int):
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    return httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S)


def test_a_killed_core_fails_requests_in_flight_and_health_turns_503(tiny_path):
    engine = core_process_engine(tiny_path, before_step=paced())
    deaths: list[str] = []
    engine.on_core_death = deaths.append
    with live_server(engine) as url:
        events: list[str] = []
        started = threading.Event()

        def stream_long() -> None:
            with completion_stream(url, [1, 5, 9], 900) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        started.set()

        replies: list[httpx.Response] = []
        threads = [threading.Thread(target=stream_long),
                   threading.Thread(target=lambda: replies.append(completion(url, [1, 6], 900)))]
        for t in threads:
            t.start()
        assert started.wait(HANG_GUARD_S)
        wait_until(lambda: metric(url, "llmpipe:num_requests_running") == 2, "both requests running")
        psutil.Process(engine.client.process.pid).send_signal(signal.SIGKILL)
        for t in threads:
            t.join(HANG_GUARD_S)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "engine core process died" in error["message"]
        assert replies[0].status_code == 500 and "engine core process died" in replies[0].json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503
        assert completion(url, [1, 2], 2).status_code == 503  # refused at once, not hung
        assert deaths and "exit code -9" in deaths[0]


def serve(tiny_path: str, *extra: str) -> tuple[subprocess.Popen, str]:
    return serve_process("serve", "--model", tiny_path, *extra)


def test_llmpipe_serve_exits_nonzero_when_its_core_is_killed(tiny_path):
    server, url = serve(tiny_path)
    try:
        core_of(server.pid).send_signal(signal.SIGKILL)
        assert server.wait(HANG_GUARD_S) == 1
        assert "engine core process died" in server.stderr.read()
    finally:
        server.kill()


def test_the_core_exits_when_the_api_server_is_killed(tiny_path):
    server, url = serve(tiny_path)
    try:
        core = core_of(server.pid)
        server.send_signal(signal.SIGKILL)
        core.wait(HANG_GUARD_S)  # raises psutil.TimeoutExpired if it outlived the server
        assert not core.is_running()
    finally:
        server.kill()


def test_a_core_that_cannot_load_is_one_readable_line(tiny_path, tmp_path):
    """The API server loads the target's tokenizer; only the core loads the draft, and fails."""
    missing = tmp_path / "no-such-draft"
    command = [sys.executable, "-m", "llmpipe.cli", "serve", "--model", tiny_path, "--port", str(free_port()),
               "--speculative-model", str(missing)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode != 0
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("llmpipe: error:")]
    assert len(lines) == 1 and str(missing) in lines[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("options", [{"speculative_method": "ngram"}, {"tensor_parallel_size": 2}],
                         ids=["ngram-speculation", "tensor-parallel-2"])
def test_speculation_and_tensor_parallelism_run_inside_the_core_process(tiny_path, options):
    """The core process proposes and verifies drafts, or starts the tensor-parallel ranks itself;
    the served greedy tokens are still transformers'."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    with live_server(core_process_engine(tiny_path, **options)) as url:
        for prompt in PROMPTS[:2]:
            body = {"prompt": prompt, "max_tokens": STEPS, "temperature": 0.0, "ignore_eos": True,
                    "return_tokens_as_token_ids": True, "logprobs": 1}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S).json()
            tokens = [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]
            assert_greedy_matches(tokens, hf_greedy(model, prompt, STEPS))
