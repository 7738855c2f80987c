"""64 concurrent streaming clients on loopback: every one gets transformers' greedy output, whole."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
import tokenizers
import torch
import transformers

from tests.server.utils import metric
from tests.server.references import assert_greedy_matches, hf_greedy, token_ids_of

NUM_CLIENTS = 64
MAX_TOKENS = 16


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: list[int]) -> dict:
    body = {
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True, "logprobs": 0,
        "ignore_eos": True, "return_tokens_as_token_ids": True,
    }
    text, tokens, finish, done = "", [], None, False
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            text += choice["text"]
            tokens += choice["logprobs"]["tokens"]
            finish = choice["finish_reason"] or finish
    return {"text": text, "ids": token_ids_of(tokens), "finish": finish, "done": done}


async def run_clients(url: str, prompts: list[list[int]]) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(stream_completion(client, url, p) for p in prompts))


def test_64_concurrent_streams_all_complete_with_transformers_output(tiny_url, tiny_path):
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 320) for _ in range(rng.randint(4, 40))] for _ in range(NUM_CLIENTS)]
    results = asyncio.run(run_clients(tiny_url, prompts))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    hf_tokenizer = tokenizers.Tokenizer.from_file(f"{tiny_path}/tokenizer.json")
    for prompt, result in zip(prompts, results):
        assert result["done"] and result["finish"] == "length"
        assert len(result["ids"]) == MAX_TOKENS
        assert_greedy_matches(result["ids"], hf_greedy(reference, prompt, MAX_TOKENS))
        assert result["text"] == hf_tokenizer.decode(result["ids"], skip_special_tokens=True)


@pytest.fixture(autouse=True)
def _no_leak(tiny_url):
    yield
    assert metric(tiny_url, "llmpipe:kv_cache_usage_perc") == 0.0
