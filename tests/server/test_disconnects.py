"""Clients that hang up mid-stream, mid-prefill or while waiting for a whole reply: their requests are
aborted, their KV blocks freed at once, and the requests after them are unaffected.

The server is paced (each engine step lasts at least STEP_DELAY_S), so a dropped request cannot
finish before the server sees its client leave; bounds count engine steps, not seconds."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
import torch
import transformers

from llmpipe import LLM
from tests.server.conftest import live_server, metric, paced, wait_until
from tests.server.references import assert_greedy_matches, hf_greedy, token_ids_of

NUM_DROPPERS = 20
LONG = 900  # tokens a dropped request would have generated (max_model_len is 1024)
# Steps an abort may take to reach the engine once the client has left: the server notices on its
# event loop (at once on loopback) and the engine applies it before its next step; at 50 ms a step,
# 20 steps leave a second for the notice to travel on a loaded machine.
MAX_STEPS_AFTER_DISCONNECT = 20


@pytest.fixture(scope="module")
def url(tiny_path):
    # Small prefill chunks, so a long prompt takes many steps to prefill.
    with live_server(LLM(tiny_path, progress=False, max_num_batched_tokens=64), before_step=paced()) as url:
        yield url


def wait_until_idle(url: str) -> None:
    """Until no request runs and no KV block is in use."""
    wait_until(lambda: metric(url, "llmpipe:kv_cache_usage_perc") == 0
               and metric(url, "llmpipe:num_requests_running") == 0, "KV blocks still in use")


def body(prompt, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": LONG, "temperature": 0.0, "ignore_eos": True, **extra}


async def drop_after(client: httpx.AsyncClient, url: str, chunks: int, prompt) -> int:
    """Stream, read `chunks` events, then close the connection; returns the events read."""
    seen = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body(prompt, stream=True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= chunks:
                    break
    return seen


async def drop_many(url: str, chunks: int, prompts: list) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(drop_after(client, url, chunks, p) for p in prompts))


def assert_later_request_unaffected(url: str, tiny_path: str) -> None:
    prompt = [1, 40, 80, 120, 160, 200]
    out = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
              "return_tokens_as_token_ids": True},
        timeout=60,
    ).json()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    assert_greedy_matches(token_ids_of(out["choices"][0]["logprobs"]["tokens"]), hf_greedy(reference, prompt, 12))


def test_20_clients_dropping_mid_stream_free_their_blocks(url, tiny_path):
    before = metric(url, "llmpipe:generation_tokens_total")
    prompts = [[1, 10 + i, 20 + i, 30 + i] for i in range(NUM_DROPPERS)]
    assert asyncio.run(drop_many(url, 3, prompts)) == [3] * NUM_DROPPERS
    wait_until_idle(url)
    generated = metric(url, "llmpipe:generation_tokens_total") - before
    # each dropper read 3 tokens; after that only the steps until its abort arrived
    assert generated <= NUM_DROPPERS * (3 + MAX_STEPS_AFTER_DISCONNECT), "the dropped requests ran on"
    time.sleep(0.3)
    assert metric(url, "llmpipe:generation_tokens_total") - before == generated
    assert_later_request_unaffected(url, tiny_path)


def test_client_dropping_mid_prefill_aborts_before_any_token(url, tiny_path):
    before = metric(url, "llmpipe:prompt_tokens_total"), metric(url, "llmpipe:generation_tokens_total")
    # 1,000 prompt tokens in chunks of 64: the first token is 16 steps away when the client leaves.
    long_prompt = [(7 * i) % 300 + 5 for i in range(1000)]
    with httpx.stream("POST", f"{url}/v1/completions", json=body(long_prompt, max_tokens=8, stream=True)) as r:
        assert r.status_code == 200
    wait_until_idle(url)
    after = metric(url, "llmpipe:prompt_tokens_total"), metric(url, "llmpipe:generation_tokens_total")
    assert after == before, "the request got to its first token"
    assert_later_request_unaffected(url, tiny_path)


def test_client_leaving_a_non_streaming_request_aborts_it_within_a_few_steps(url):
    """The server watches for the disconnect while it generates, not only when it writes the reply."""
    tokens = lambda: metric(url, "llmpipe:generation_tokens_total")  # noqa: E731
    before = tokens()
    address = urlsplit(url)
    request = json.dumps(body([1, 2, 3, 4])).encode()
    with socket.create_connection((address.hostname, address.port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(request), request))
        wait_until(lambda: tokens() > before, "the request never started generating")
        at_disconnect = tokens()
    wait_until_idle(url)
    assert tokens() - at_disconnect <= MAX_STEPS_AFTER_DISCONNECT  # one token a step: it runs alone
