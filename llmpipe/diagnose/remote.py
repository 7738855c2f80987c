"""Probing a running OpenAI-compatible server: stream /v1/completions and time TTFT and ITL client-side.

Where the server's final chunk carries `llmpipe_timing` (llmpipe's server does), its queue /
prefill / decode split is used and the rest of the client's wall time is HTTP and streaming
overhead; otherwise prefill = TTFT (queueing included) and overhead = after the last token.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import httpx

from llmpipe.diagnose.report import TimeSplit, Workload
from llmpipe.errors import LLMPipeError
from llmpipe.server.sse import sse_lines

logger = logging.getLogger(__name__)

# Common English words: one token each in most BPE vocabularies, so N words ≈ N prompt tokens.
WORDS = ("the time people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government "
         "number night point home water room mother area money story fact month lot right study book "
         "eye job word business issue side kind head house service friend father power hour game line").split()


def probe_prompt(length: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(length))


@dataclass
class StreamTiming:
    """One streamed completion, as the client saw it (time.perf_counter seconds)."""

    sent: float
    end: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    completion_tokens: int | None = None  # from `usage`, when the server reports it
    prompt_tokens: int | None = None
    server_timing: dict | None = None  # `llmpipe_timing`

    @property
    def tokens(self) -> int:
        return self.completion_tokens or len(self.chunk_times)


class RemoteServer:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 clock: Callable[[], float] = time.perf_counter):
        """`clock`: where stream timings come from (tests give a virtual one)."""
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.ignore_eos = True  # dropped if the server rejects the field
        self.clock = clock

    def __enter__(self) -> "RemoteServer":
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()

    def first_model(self) -> str:
        try:
            body = self._json(self.client.get("/v1/models"))
        except httpx.HTTPError as exc:
            raise LLMPipeError(f"{self.base_url}: {exc}") from exc
        models = body.get("data") or []
        if not models:
            raise LLMPipeError(f"{self.base_url}/v1/models lists no model; pass --model")
        return models[0]["id"]

    def stream(self, model: str, prompt: str, max_tokens: int) -> StreamTiming:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM / llama.cpp / llmpipe extension: exactly max_tokens tokens
        timing = StreamTiming(sent=self.clock(), end=0.0)
        try:
            with self.client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    self._json(response)
                buffer = ""
                for text in response.iter_text():
                    lines, buffer = sse_lines(buffer, text)
                    for line in lines:
                        if line.startswith("data:") and line[5:].strip() != "[DONE]":
                            _record_chunk(timing, json.loads(line[5:]), self.clock())
        except httpx.HTTPError as exc:
            raise LLMPipeError(f"{self.base_url}: {exc}") from exc
        timing.end = self.clock()
        return timing

    def _json(self, response: httpx.Response) -> dict:
        if response.status_code != 200:
            raise LLMPipeError(f"{response.request.url}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json()


def _record_chunk(timing: StreamTiming, chunk: dict, now: float) -> None:
    choices = chunk.get("choices") or []
    if any(c.get("text") for c in choices):
        timing.chunk_times.append(now)
    usage = chunk.get("usage") or {}
    timing.completion_tokens = usage.get("completion_tokens", timing.completion_tokens)
    timing.prompt_tokens = usage.get("prompt_tokens", timing.prompt_tokens)
    server = chunk.get("llmpipe_timing") or next((c["llmpipe_timing"] for c in choices if "llmpipe_timing" in c), None)
    timing.server_timing = server or timing.server_timing


def run_remote_probe(server: RemoteServer, model: str, prompt_len: int, output_len: int,
                     batch: int = 1) -> tuple[Workload, TimeSplit]:
    """`batch` concurrent streamed completions (after one warm-up request)."""
    try:
        server.stream(model, probe_prompt(8, seed=-1), 2)
    except LLMPipeError as err:
        if "HTTP 4" not in str(err):
            raise
        logger.warning("server refused ignore_eos; replies may end before %d tokens", output_len)
        server.ignore_eos = False
        server.stream(model, probe_prompt(8, seed=-1), 2)
    prompts = [probe_prompt(prompt_len, seed=i) for i in range(batch)]
    with ThreadPoolExecutor(max_workers=batch) as pool:
        streams = list(pool.map(lambda p: server.stream(model, p, output_len), prompts))
    if not all(s.chunk_times for s in streams):
        raise LLMPipeError(f"{server.base_url}: a streamed completion carried no text")
    prompt_tokens = [s.prompt_tokens for s in streams if s.prompt_tokens]
    measured_len = round(statistics.fmean(prompt_tokens)) if prompt_tokens else prompt_len
    workload = Workload(measured_len, statistics.fmean(s.tokens for s in streams), batch)
    return workload, split_streams(streams)


def split_streams(streams: list[StreamTiming]) -> TimeSplit:
    """Mean per-request split of client-side stream timings (the server's own split where given)."""
    rows = [_split_one(s) for s in streams]
    itls = [(s.chunk_times[-1] - s.chunk_times[0]) / (s.tokens - 1) for s in streams if s.tokens > 1]
    gaps = [b - a for s in streams for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    queued = min(r[0] for r in rows)
    return TimeSplit(
        *(statistics.fmean(r[i] for r in rows) for i in range(4)),
        mean_itl_s=statistics.fmean(itls) if itls else None,
        max_itl_s=max(gaps) if gaps else None,
        prefill_wall_s=max(s.chunk_times[0] for s in streams) - min(s.sent for s in streams) - queued,
    )


def _split_one(s: StreamTiming) -> tuple[float, float, float, float]:
    total = s.end - s.sent
    server = s.server_timing or {}
    if all(isinstance(server.get(k), (int, float)) for k in ("queue_s", "prefill_s")):
        queue, prefill, decode = server["queue_s"], server["prefill_s"], server.get("decode_s") or 0.0
        return queue, prefill, decode, max(total - queue - prefill - decode, 0.0)
    first, last = s.chunk_times[0], s.chunk_times[-1]
    return 0.0, first - s.sent, last - first, s.end - last
