"""`llmpipe bench serve`: load-test any OpenAI-compatible server, the way vLLM's `bench serve` does.

Requests arrive as a Poisson process (exponential gaps at --request-rate; inf sends them all at
once), at most --max-concurrency in flight, each a streamed /v1/completions of --input-len random
prompt token ids and exactly --output-len generated tokens (ignore_eos). From the stream: TTFT
(first text), ITL (gaps between text chunks), TPOT ((latency - TTFT) / (tokens - 1)), end-to-end
latency; then request and token throughput over the run. One run per --max-concurrency value.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import httpx
import numpy as np

from llmpipe.bench.report import format_table, random_prompt, write_json
from llmpipe.errors import LLMPipeError
from llmpipe.server.sse import sse_lines

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""  # the streamed text (of one-choice requests), e.g. to resend as the next chat turn

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def poisson_arrivals(
    n: int, rate: float, rng: random.Random, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
) -> AsyncIterator[int]:
    """Yield 0..n-1, each after an exponential gap of mean 1/rate seconds (none when rate is inf)."""
    for i in range(n):
        if i and math.isfinite(rate):
            await sleep(rng.expovariate(rate))
        yield i


async def stream_lines(response: httpx.Response) -> AsyncIterator[str]:
    buffer = ""
    async for text in response.aiter_text():
        lines, buffer = sse_lines(buffer, text)
        for line in lines:
            yield line
    if buffer:
        yield buffer


async def send_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in stream_lines(response):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: ") :])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                now = time.perf_counter()
                texts = [chunk_text(choice) for choice in data.get("choices", [])]
                if any(texts):
                    result.text += texts[0]
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks, last = chunks + 1, now
                if data.get("usage"):
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                    result.output_tokens = data["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    result.error = "" if result.ok else "no text came back"
    return result


def chunk_text(choice: dict) -> str:
    """A streamed choice's new text: /v1/completions' `text`, or /v1/chat/completions' `delta.content`."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def percentiles(values: list[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds (None when there are no values)."""
    if not values:
        return {"mean_ms": None, **{f"p{p}_ms": None for p in PERCENTILES}}
    ms = np.asarray(values) * 1000
    return {"mean_ms": float(ms.mean()), **{f"p{p}_ms": float(np.percentile(ms, p)) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2e": [r.latency for r in done],
    }
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        **{name: percentiles(values) for name, values in samples.items()},
    }


async def run_benchmark(args, concurrency: int | None, num_prompts: int, model: str) -> dict:
    rng = random.Random(args.seed)
    bodies = [
        {
            "model": model,
            "prompt": random_prompt(args.vocab_size, args.input_len, seed=args.seed * 100_003 + i),
            "max_tokens": args.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(num_prompts)
    ]
    limit = asyncio.Semaphore(concurrency or num_prompts)
    url = f"{args.base_url.rstrip('/')}/v1/completions"

    async def one(client: httpx.AsyncClient, body: dict) -> RequestResult:
        async with limit:
            return await send_request(client, url, body)

    limits = httpx.Limits(max_connections=concurrency or num_prompts)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=_headers(args)) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(client, bodies[i])) async for i in poisson_arrivals(num_prompts, args.request_rate, rng)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return {"max_concurrency": concurrency, "num_prompts": num_prompts, **summarize(results, duration)}


def _headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def served_model(args) -> str:
    """--model, or the first model the server lists (waiting up to --wait-for-server seconds for it)."""
    deadline = time.monotonic() + args.wait_for_server
    while True:
        try:
            response = httpx.get(f"{args.base_url.rstrip('/')}/v1/models", headers=_headers(args), timeout=30)
            response.raise_for_status()
            return args.model or response.json()["data"][0]["id"]
        except httpx.TransportError as err:
            if time.monotonic() > deadline:
                if args.model:
                    return args.model  # let the runs count the failures
                raise LLMPipeError(f"no server answers at {args.base_url} ({err})") from err
            time.sleep(0.5)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
            if args.model:
                return args.model
            raise LLMPipeError(f"cannot list the models at {args.base_url} ({err}); pass --model") from err


def report_table(runs: list[dict]) -> str:
    def ms(run: dict, metric: str, stat: str) -> str:
        value = run[metric][stat]
        return "-" if value is None else f"{value:.0f}"

    rows = [["concurrency", "done/failed", "req/s", "out tok/s", "TTFT mean", "TTFT p99", "TPOT mean",
             "ITL p50", "ITL p99", "E2E p50", "E2E p99"]]
    for run in runs:
        rows.append([
            str(run["max_concurrency"] or "inf"),
            f"{run['completed']}/{run['failed']}",
            f"{run['request_throughput']:.2f}",
            f"{run['output_throughput']:.1f}",
            ms(run, "ttft", "mean_ms"), ms(run, "ttft", "p99_ms"), ms(run, "tpot", "mean_ms"),
            ms(run, "itl", "p50_ms"), ms(run, "itl", "p99_ms"), ms(run, "e2e", "p50_ms"), ms(run, "e2e", "p99_ms"),
        ])
    return format_table(rows) + "\n(latencies in ms)"


def plot_serve(runs: list[dict], path: str | Path, title: str, peer: list[dict] | None = None) -> Path:
    """Latency percentiles (log scale) per run, and throughput against concurrency (and a peer's
    runs of the same load, if given)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    lat, tput = fig.subplots(1, 2, width_ratios=(2, 1))
    labels = [f"c={run['max_concurrency'] or 'inf'}" for run in runs]
    stats = [f"p{p}_ms" for p in PERCENTILES]
    width = 0.8 / (len(LATENCIES) * len(stats))
    for m, metric in enumerate(LATENCIES):
        for s, stat in enumerate(stats):
            offset = (m * len(stats) + s) * width - 0.4 + width / 2
            values = [run[metric][stat] or 0 for run in runs]
            lat.bar(np.arange(len(runs)) + offset, values, width, color=f"C{m}", alpha=0.45 + 0.25 * s,
                    label=f"{metric.upper()} {stat[:-3]}")
    lat.set_yscale("log")
    lat.set_xticks(np.arange(len(runs)), labels)
    lat.set_ylabel("milliseconds")
    lat.set_title("latency percentiles")
    lat.legend(ncol=4, fontsize=7)
    x = [run["max_concurrency"] or run["num_prompts"] for run in runs]
    tput.plot(x, [run["output_throughput"] for run in runs], "o-", label="output tokens/s")
    tput.plot(x, [run["total_token_throughput"] for run in runs], "s--", label="total tokens/s")
    if peer:
        tput.plot(x, [run["output_throughput"] for run in peer], "^:", color="C3", label="peer output tokens/s")
    tput.set_xscale("log", base=2)
    tput.set_xticks(x, [str(v) for v in x])
    tput.set_xlabel("max concurrency")
    tput.set_ylabel("tokens/s")
    tput.set_title("throughput")
    tput.legend(fontsize=8)
    fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(args) -> dict:
    concurrencies = args.max_concurrency or [None]
    counts = args.num_prompts if len(args.num_prompts) > 1 else args.num_prompts * len(concurrencies)
    if len(counts) != len(concurrencies):
        raise LLMPipeError("--num-prompts takes one count, or one per --max-concurrency value")
    model = served_model(args)
    runs = [asyncio.run(run_benchmark(args, c, n, model)) for c, n in zip(concurrencies, counts)]
    report = {
        "config": {
            "base_url": args.base_url, "model": model, "request_rate": args.request_rate,
            "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
        },
        "runs": runs,
    }
    print(report_table(runs))
    write_outputs(args, report, runs, f"{model}: {args.input_len} in / {args.output_len} out, request rate {args.request_rate}")
    return report


def write_outputs(args, report: dict, runs: list[dict], title: str, peer: list[dict] | None = None) -> None:
    """--json and --plot, where asked for."""
    if args.json:
        print(f"wrote {write_json(args.json, report)}")
    if args.plot:
        print(f"wrote {plot_serve(runs, args.plot, title, peer)}")
