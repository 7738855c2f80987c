"""Nothing heavy runs on the event loop, and no client can hold a connection open without sending.

Speed-independent: the big request's effect is measured as ratios against the same server without
it, in the same test, and the engine is paced so a stream's gaps are set by the pacing."""

from __future__ import annotations

import socket
import statistics
import threading
import time

import httpx
import pytest

from tests.server.conftest import live_server, paced

BIG_PROMPT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 80_000)[
    : 7 * 2**20
]  # 7 MiB


class Stream:
    """A long streamed request in a thread, recording when each chunk arrives."""

    def __init__(self, url: str) -> None:
        self.arrivals: list[float] = []
        self._stop = threading.Event()
        body = {"prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.arrivals.append(time.perf_counter())
                if self._stop.is_set():
                    return

    def gaps(self, start: float, end: float) -> list[float]:
        times = [t for t in self.arrivals if start <= t <= end]
        return [b - a for a, b in zip(times, times[1:])]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def health_latencies(url: str, until) -> list[float]:
    """Poll /health until `until()` is true; each poll's latency."""
    latencies = []
    with httpx.Client(timeout=120) as client:
        while not until():
            start = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    return latencies


@pytest.mark.parametrize(
    "route,body",
    [
        ("/tokenize", {"prompt": BIG_PROMPT}),
        ("/tokenize", {"messages": [{"role": "user", "content": BIG_PROMPT}]}),
    ],
    ids=["prompt-7MiB", "chat-content-7MiB"],
)
def test_a_huge_request_neither_stalls_health_nor_slows_another_stream(tiny_llm, route, body):
    with live_server(tiny_llm, before_step=paced()) as url:
        stream = Stream(url)
        deadline = time.monotonic() + 120  # a hang guard
        while len(stream.arrivals) < 3:
            assert time.monotonic() < deadline, "the stream never started"
            time.sleep(0.01)
        start = time.perf_counter()
        quiet = health_latencies(url, lambda: time.perf_counter() - start > 1.5)
        quiet_end = time.perf_counter()

        done = threading.Event()
        result = {}

        def big() -> None:
            result["response"] = httpx.post(f"{url}{route}", json=body, timeout=120)
            done.set()

        big_start = time.perf_counter()
        threading.Thread(target=big, daemon=True).start()
        busy = health_latencies(url, done.is_set)
        big_end = time.perf_counter()
        window_end = max(big_end, big_start + (quiet_end - start))  # as long as the quiet window, at least
        while time.perf_counter() < window_end:
            time.sleep(0.01)
        stream.close()

    assert result["response"].status_code in (200, 400)
    big_time = big_end - big_start
    # The loop answered throughout: /health polls came back while the big request was being handled,
    # each in a small fraction of its time (a blocked loop answers none until it is done).
    assert len(busy) >= 3, f"{len(busy)} health checks answered during {big_time:.2f} s"
    assert max(busy) <= max(0.25 * big_time, 10 * max(quiet)), (max(busy), big_time, max(quiet))
    quiet_gaps, busy_gaps = stream.gaps(start, quiet_end), stream.gaps(big_start, window_end)
    assert busy_gaps, "the stream sent nothing while the big request was handled"
    assert statistics.mean(busy_gaps) <= 2 * statistics.mean(quiet_gaps), (busy_gaps, quiet_gaps)


def test_a_connection_that_stalls_before_its_headers_end_is_closed(tiny_llm):
    with live_server(tiny_llm, header_timeout=1.0) as url:
        host, port = url.removeprefix("http://").split(":")
        stalled = [socket.create_connection((host, int(port)), timeout=60) for _ in range(10)]
        for sock in stalled:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        for sock in stalled:
            assert sock.recv(1024) == b""  # closed by the server (a hang guard: the 60 s socket timeout)
            sock.close()
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_body_that_never_arrives_gets_408(tiny_llm):
    with live_server(tiny_llm, body_timeout=1.0) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\":")
            reply = b""
            while b"\r\n\r\n" not in reply or b"}" not in reply:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
