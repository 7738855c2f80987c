"""`llmpipe bench serve --peer llama.cpp`: the same load against `llmpipe serve` and llama.cpp's
`llama-server` on the same GGUF, one server at a time (they would share the cores otherwise),
each warmed up by one request first; a table of llmpipe / llama-server ratios per concurrency.

llama-server runs as its users run it for many streams: `-t THREADS --parallel P -cb -fa off`
with a context of P × (input + output + slack). In this llama.cpp version its weight repacking
(AMX) crashes at start-up on some AVX-512 CPUs; it is then restarted with `--no-repack`, and the
report says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from llmpipe.bench import serve
from llmpipe.bench.peers import PeerUnavailableError, binary
from llmpipe.bench.report import format_table
from llmpipe.errors import LLMPipeError
from llmpipe.loader.aliases import resolve_model

START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(command: list[str], port: int, log: Path) -> Iterator[subprocess.Popen]:
    """Start a server and wait until it answers /v1/models; stop it (SIGINT, then SIGKILL) on exit."""
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_until_up(process, port, log)
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_until_up(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-2:]
            raise PeerUnavailableError(f"{Path(process.args[0]).name} exited with {process.returncode}: {' | '.join(tail)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise PeerUnavailableError(f"{process.args[0]} did not come up in {START_TIMEOUT_S:.0f} s (see {log})")


def llmpipe_command(args, port: int) -> list[str]:
    return [sys.executable, "-m", "llmpipe.cli", "serve", "--model", args.model, "--port", str(port),
            "--num-threads", str(args.threads), *args.serve_args]


def llama_server_command(args, gguf: Path, port: int, extra: list[str]) -> list[str]:
    parallel = max(args.max_concurrency or [1])
    context = parallel * (args.input_len + args.output_len + 64)
    return [str(binary("llama-server")), "-m", str(gguf), "-t", str(args.threads), "--parallel", str(parallel),
            "-cb", "-fa", "off", "-c", str(context), "--port", str(port), *extra]


def load_runs(args, port: int, model: str) -> list[dict]:
    """A warm-up request, then one run per concurrency against the server on `port`."""
    args.base_url = f"http://127.0.0.1:{port}"
    counts = args.num_prompts if len(args.num_prompts) > 1 else args.num_prompts * len(args.max_concurrency)
    asyncio.run(_warm_up(args, model))  # the first request pays for lazy initialisation
    return [asyncio.run(serve.run_benchmark(args, c, n, model)) for c, n in zip(args.max_concurrency, counts)]


async def _warm_up(args, model: str) -> None:
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        await serve.send_request(client, f"{args.base_url}/v1/completions", body)


def main(args) -> dict:
    if not args.max_concurrency:
        raise LLMPipeError("--peer needs --max-concurrency (one run per value)")
    gguf = Path(resolve_model(args.model))
    if gguf.suffix != ".gguf":
        raise LLMPipeError(f"--peer llama.cpp runs the same GGUF file: {args.model} is not one")
    logs = Path(args.json or "bench_results/serve_peer.json").with_suffix("")
    logs.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with running(llmpipe_command(args, port), port, Path(f"{logs}.llmpipe.log")):
        ours = load_runs(args, port, _model_id(port))
    peer, flags = _run_peer(args, gguf, logs)
    offline = offline_itl(args)
    report = {
        "config": {"model": args.model, "gguf": str(gguf), "threads": args.threads, "input_len": args.input_len,
                   "output_len": args.output_len, "request_rate": args.request_rate, "seed": args.seed,
                   "llmpipe": " ".join(llmpipe_command(args, 0)[2:]), "llama_server_flags": flags},
        "llmpipe": ours,
        "llama.cpp": peer,
        "ratios": [ratio_row(a, b) for a, b in zip(ours, peer)],
        "offline_itl": offline,
        "served_over_offline_itl_p50": ours[0]["itl"]["p50_ms"] / offline["p50_ms"]
        if ours[0]["max_concurrency"] == 1 and ours[0]["itl"]["p50_ms"] else None,
    }
    print("llmpipe serve\n" + serve.report_table(ours))
    print(f"\nllama-server ({flags})\n" + serve.report_table(peer))
    print("\nllmpipe / llama-server\n" + ratio_table(report["ratios"]))
    if report["served_over_offline_itl_p50"] is not None:
        print(f"\nserved c1 ITL p50 / offline ITL p50 (the same engine, in-process): "
              f"{ours[0]['itl']['p50_ms']:.1f} / {offline['p50_ms']:.1f} ms = {report['served_over_offline_itl_p50']:.2f}")
    serve.write_outputs(args, report, ours, f"{args.model}: llmpipe vs llama-server, "
                        f"{args.input_len} in / {args.output_len} out", peer)
    return report


def offline_itl(args, num_prompts: int = 4) -> dict[str, float | None]:
    """The same engine in-process (`LLM.generate`, one prompt at a time): its ITL percentiles."""
    from llmpipe import LLM, SamplingParams
    from llmpipe.bench.report import random_prompt

    llm = LLM(args.model, progress=False, num_threads=args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    gaps: list[float] = []
    for i in range(num_prompts + 1):  # the first one warms up
        prompt = random_prompt(args.vocab_size, args.input_len, seed=10_000 + i)
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        gaps += output.metrics.itl if i else []
    llm.close()
    return serve.percentiles(gaps)


def _model_id(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]


def _run_peer(args, gguf: Path, logs: Path) -> tuple[list[dict], str]:
    """llama-server's runs and its flags: as configured, or with `--no-repack` if that crashes."""
    try:
        return _peer_runs(args, gguf, logs, [])
    except PeerUnavailableError:
        return _peer_runs(args, gguf, logs, ["--no-repack"])


def _peer_runs(args, gguf: Path, logs: Path, extra: list[str]) -> tuple[list[dict], str]:
    port = free_port()
    with running(llama_server_command(args, gguf, port, extra), port, Path(f"{logs}.llama-server.log")):
        return load_runs(args, port, _model_id(port)), " ".join(llama_server_command(args, gguf, 0, extra)[3:])


def ratio_row(ours: dict, peer: dict) -> dict:
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    return {
        "max_concurrency": ours["max_concurrency"],
        "output_throughput": ratio(ours["output_throughput"], peer["output_throughput"]),
        "ttft_p99": ratio(ours["ttft"]["p99_ms"], peer["ttft"]["p99_ms"]),
        "itl_p50": ratio(ours["itl"]["p50_ms"], peer["itl"]["p50_ms"]),
        "itl_p99_over_p50": ratio(ours["itl"]["p99_ms"], ours["itl"]["p50_ms"]),
        "failed": ours["failed"],
    }


def ratio_table(rows: list[dict]) -> str:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    header = ["concurrency", "out tok/s ×", "TTFT p99 ×", "ITL p50 ×", "our ITL p99/p50", "our failures"]
    return format_table([header] + [[str(r["max_concurrency"]), fmt(r["output_throughput"]), fmt(r["ttft_p99"]),
                                     fmt(r["itl_p50"]), fmt(r["itl_p99_over_p50"]), str(r["failed"])] for r in rows])
