"""`llmpipe bench robustness`: what one huge or hostile request does to everyone else on a server.

Each probe runs beside a long streamed completion while /health is polled: the probe's answer and
how long it took, the worst /health latency meanwhile, and the stream's mean chunk gap during the
probe as a ratio of its own gap in a quiet window just before (same length). Then connections that
stall mid-headers: how many the server closes, and when. Any OpenAI-compatible server works.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx

def _chain(rule: str, n: int, defines: str) -> str:
    """A grammar of n rules, each naming the next: what a compiler recurses n deep over."""
    root = "root" if defines == "::=" else "start"
    return f"{root} {defines} r0\n" + "\n".join(rule.format(i, i + 1) for i in range(n)) + f'\nr{n} {defines} "x"\n'


BIG_TEXT = ("To be, or not to be, that is the question. " * 200_000)[: 7 * 2**20]  # 7 MiB
PROBES = {
    "7 MiB prompt": ("/v1/completions", {"prompt": BIG_TEXT}),
    "7 MiB chat content": ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG_TEXT}]}),
    "200,000 messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 200_000}),
    "/tokenize 7 MiB": ("/tokenize", {"prompt": BIG_TEXT}),
    "/detokenize 1.4 M ids": ("/detokenize", {"tokens": [123] * 1_400_000}),
    "70,000 stop strings": ("/v1/completions", {"prompt": "x", "stop": ["s" * 100] * 70_000}),
    # Constraints: compiled where they cost no one else (a worker process, niced core threads).
    # the first constraint: the engine's grammar vocabulary is built, the grammar workers start
    "a small JSON schema (first use)": ("/v1/completions", {"prompt": "x", "max_tokens": 4, "structured_outputs": {
        "json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}),
    "3,000-rule GBNF grammar": ("/v1/completions", {"prompt": "x", "max_tokens": 4,
                                                    "guided_grammar": _chain("r{} ::= r{}", 3000, "::=")}),
    "3,000-rule Lark grammar": ("/v1/completions", {"prompt": "x", "max_tokens": 4,
                                                    "structured_outputs": {"grammar": _chain("r{}: r{}", 3000, ":")}}),
    "$ref chain of 3,000": ("/v1/completions", {"prompt": "x", "max_tokens": 4, "structured_outputs": {"json": {
        "$defs": {**{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}, "d3000": {"type": "integer"}},
        "$ref": "#/$defs/d0"}}}),
}
QUIET_S = 2.0
POLL_S = 0.02


@dataclass
class ProbeResult:
    probe: str
    status: int
    answer_s: float
    health_worst_s: float
    health_polls: int
    gap_quiet_s: float
    gap_during_s: float
    gap_worst_s: float  # the longest the stream waited during the probe: a stalled loop shows here

    @property
    def gap_ratio(self) -> float:
        return self.gap_during_s / self.gap_quiet_s


class _Stream:
    """A long streamed completion in a thread, recording when each chunk arrives."""

    def __init__(self, base_url: str, headers: dict, model: str | None) -> None:
        self.arrivals: list[float] = []
        self.stop = threading.Event()
        body = {"prompt": "Once upon a time", "max_tokens": None, "ignore_eos": True, "stream": True}  # the whole context
        if model:
            body["model"] = model
        self._thread = threading.Thread(target=self._run, args=(base_url, body, headers), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, body: dict, headers: dict) -> None:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers, timeout=600) as response:
            for _ in response.iter_lines():
                self.arrivals.append(time.perf_counter())
                if self.stop.is_set():
                    return

    def gaps(self, start: float, end: float, edges: bool = False) -> list[float]:
        """Gaps between chunks in [start, end]; with `edges`, also from the last chunk before start and
        to the first after end (so a stall that spans either edge counts)."""
        before = [t for t in self.arrivals if t < start][-1:] if edges else []
        after = [t for t in self.arrivals if t > end][:1] if edges else []
        times = before + [t for t in self.arrivals if start <= t <= end] + after
        return [b - a for a, b in zip(times, times[1:])] or [float("nan")]

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=60)


def probe(base_url: str, name: str, headers: dict, model: str | None) -> ProbeResult:
    route, body = PROBES[name]
    if model and route != "/detokenize":
        body = {**body, "model": model}
    stream = _Stream(base_url, headers, model)
    while len(stream.arrivals) < 10:
        if not stream.alive:
            raise RuntimeError(f"the background stream ended after {len(stream.arrivals)} chunks")
        time.sleep(POLL_S)
    quiet_start = time.perf_counter()
    time.sleep(QUIET_S)
    start, answer, done = time.perf_counter(), {}, threading.Event()

    def send() -> None:
        content = json.dumps(body).encode()
        response = httpx.post(f"{base_url}{route}", content=content, timeout=600,
                              headers={**headers, "Content-Type": "application/json"})
        answer.update(status=response.status_code, seconds=time.perf_counter() - start)
        done.set()

    threading.Thread(target=send, daemon=True).start()
    health = []
    while not done.is_set():
        polled = time.perf_counter()
        httpx.get(f"{base_url}/health", timeout=600)
        health.append(time.perf_counter() - polled)
        time.sleep(POLL_S)
    end = max(time.perf_counter(), start + QUIET_S)
    time.sleep(max(0.0, end - time.perf_counter()))
    stream.close()
    during = stream.gaps(start, end, edges=True)
    return ProbeResult(name, answer["status"], answer["seconds"], max(health), len(health),
                       statistics.mean(stream.gaps(quiet_start, start)), statistics.mean(during), max(during))


def stalled_headers(base_url: str, connections: int = 10, wait_s: float = 120.0) -> tuple[int, float]:
    """Open connections that never finish their headers: (how many the server closed, after how long)."""
    url = urlparse(base_url)
    socks = [socket.create_connection((url.hostname, url.port or 80), timeout=wait_s) for _ in range(connections)]
    start, closed = time.perf_counter(), 0
    for sock in socks:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
    for sock in socks:
        sock.settimeout(max(0.01, start + wait_s - time.perf_counter()))  # one deadline for them all
        try:
            closed += sock.recv(16) == b""
        except OSError:  # still open at wait_s
            pass
        sock.close()
    return closed, time.perf_counter() - start


def run_robustness(base_url: str, api_key: str | None, model: str | None, output: str | None,
                   probes: list[str] | None = None, stalled: bool = True) -> list[ProbeResult]:
    """Every probe (or those named), then the stalled connections (unless not `stalled`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results = []
    print("| probe | answer | /health worst during | stream mean gap quiet → during (ratio) | stream worst gap |")
    print("|---|---|---|---|---|")
    for name in probes or PROBES:
        result = probe(base_url, name, headers, model)
        results.append(result)
        print(f"| {name} | {result.status} in {result.answer_s:.2f} s | {result.health_worst_s * 1000:.0f} ms "
              f"({result.health_polls} polls) | {result.gap_quiet_s * 1000:.0f} → {result.gap_during_s * 1000:.0f} ms "
              f"({result.gap_ratio:.2f}×) | {result.gap_worst_s * 1000:.0f} ms |", flush=True)
    closed, seconds = stalled_headers(base_url) if stalled else (None, None)
    if stalled:
        print(f"connections stalled mid-headers: {closed}/10 closed by the server after {seconds:.1f} s")
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        report = {"probes": [asdict(r) for r in results], "stalled_headers_closed": closed, "stalled_after_s": seconds}
        Path(output).write_text(json.dumps(report, indent=2))
    return results
