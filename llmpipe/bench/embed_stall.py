"""`llmpipe bench embeddings`: what a burst of embedding requests does to a stream on the same server.

A completion streams alone, then beside N clients that each send embedding requests back to back (a
RAG pipeline indexing documents while a user chats; each document of its own random words), the two
alternating, R rounds each, so drift on a shared machine falls on both. Reported: the stream's time to
first token and inter-token latency p50 / p99 in each, their ratios, and the embeddings served per second
while the stream runs and in a window without it. Any OpenAI-compatible server works.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from pathlib import Path

import httpx

DOCUMENT = ("Inference runs in two phases: prefill reads the whole prompt at once and is bound by compute, then "
            "decode writes one token at a time and is bound by memory bandwidth, reading every weight per token. ")


def stream_gaps(base_url: str, model: str, max_tokens: int) -> tuple[float, list[float]]:
    """A greedy streamed completion's time to first token, and the gaps between its chunks (a token each)."""
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    started, times = time.perf_counter(), []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times[0] - started, [b - a for a, b in zip(times, times[1:])]


class Embedders:
    """N clients sending one embedding request each, back to back, until stopped; every document its own
    words in its own order (as the chunks of a corpus are: no prefix-cache hits between them)."""

    def __init__(self, base_url: str, model: str, clients: int, words: int) -> None:
        self.model, self.words = model, words
        self.base_url, self.stopping, self.failed = base_url, threading.Event(), 0
        self.finished: list[float] = []  # when each embedding came back
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        rng, vocabulary = random.Random(), DOCUMENT.split()  # seeded afresh: no document repeats a past run's
        with httpx.Client(timeout=600) as client:
            while not self.stopping.is_set():
                document = " ".join(rng.choice(vocabulary) for _ in range(self.words))
                reply = client.post(f"{self.base_url}/v1/embeddings", json={"model": self.model, "input": document})
                if reply.status_code == 200:
                    self.finished.append(time.perf_counter())
                else:
                    self.failed += 1

    def served_within(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.finished)

    def __enter__(self) -> "Embedders":
        for thread in self.threads:
            thread.start()
        time.sleep(0.5)  # the burst is under way when the stream starts
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def run_embed_stall(base_url: str, model: str | None, clients: int, words: int, max_tokens: int, rounds: int,
                    output: str | None, alone_s: float = 20.0) -> dict:
    model = model or httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    stream_gaps(base_url, model, 8)  # warm-up
    alone: list[float] = []
    beside: list[float] = []
    ttft_alone: list[float] = []
    ttft_beside: list[float] = []
    served = failed = 0
    busy_s = 0.0
    for _ in range(rounds):
        ttft, gaps = stream_gaps(base_url, model, max_tokens)
        ttft_alone.append(ttft)
        alone += gaps
        with Embedders(base_url, model, clients, words) as burst:
            started = time.perf_counter()
            ttft, gaps = stream_gaps(base_url, model, max_tokens)
            ended = time.perf_counter()
            ttft_beside.append(ttft)
            beside += gaps
        busy_s += ended - started - ttft  # the stream's decode: what it was served beside
        served += burst.served_within(started + ttft, ended)
        failed += burst.failed
    with Embedders(base_url, model, clients, words) as burst:  # the embeddings' own pace, with no stream
        started = time.perf_counter()
        time.sleep(alone_s)
        served_alone, failed = burst.served_within(started, time.perf_counter()), failed + burst.failed
    result = {
        "base_url": base_url, "model": model, "embedding_clients": clients, "embedding_words": words,
        "stream_tokens": max_tokens, "rounds": rounds,
        "ttft_alone_ms": [1e3 * t for t in ttft_alone], "ttft_beside_embeddings_ms": [1e3 * t for t in ttft_beside],
        "itl_alone_ms": {"p50": 1e3 * percentile(alone, 50), "p99": 1e3 * percentile(alone, 99)},
        "itl_beside_embeddings_ms": {"p50": 1e3 * percentile(beside, 50), "p99": 1e3 * percentile(beside, 99)},
        "embeddings_failed": failed, "embeddings_per_s_beside_stream": served / busy_s,
        "embeddings_per_s_without_stream": served_alone / alone_s,
    }
    result["itl_p50_ratio"] = result["itl_beside_embeddings_ms"]["p50"] / result["itl_alone_ms"]["p50"]
    result["itl_p99_ratio"] = result["itl_beside_embeddings_ms"]["p99"] / result["itl_alone_ms"]["p99"]
    print(json.dumps(result, indent=2))
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(result, indent=2))
    return result
