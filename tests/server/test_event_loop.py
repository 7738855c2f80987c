"""Nothing heavy runs on the event loop, and no client can hold a connection open without sending.

Speed-independent: nothing is timed. A blocked loop answers no /health poll and sends no stream
chunk until the big request is done; a free one answers and streams while it is in flight (the big
request takes seconds on any machine, the paced stream sends a chunk every 50 ms)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from tests.server.utils import live_server, paced

BIG_PROMPT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 80_000)[
    : 7 * 2**20
]  # 7 MiB


class Stream:
    """A long streamed request in a thread, recording when each chunk arrives."""

    def __init__(self, url: str) -> None:
        self.arrivals: list[float] = []
        self.flowing = threading.Event()  # set at the third chunk
        self._stop = threading.Event()
        body = {"prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.arrivals.append(len(self.arrivals))
                    if len(self.arrivals) >= 3:
                        self.flowing.set()
                if self._stop.is_set():
                    return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def health_polls(url: str, until, answered: list[int]) -> None:
    """Poll /health back to back until `until()` is true, counting the answered polls in answered[0]."""
    with httpx.Client(timeout=120) as client:
        while not until():
            assert client.get(f"{url}/health").status_code == 200
            answered[0] += 1


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
        assert stream.flowing.wait(timeout=120), "the stream never started"  # a hang guard
        done = threading.Event()
        result = {}

        def big() -> None:
            with httpx.stream("POST", f"{url}{route}", json=body, timeout=120) as response:
                result["polls"], result["chunks"] = answered[0], len(stream.arrivals)  # as the answer begins
                result["status"] = response.status_code
                response.read()
            done.set()

        answered = [0]
        chunks_at_start = len(stream.arrivals)
        threading.Thread(target=big, daemon=True).start()
        health_polls(url, done.is_set, answered)
        stream.close()

    assert result["status"] == 200
    polls = result["polls"]
    # The loop answered and streamed throughout: a blocked one does neither until the request is done.
    assert polls >= 10, f"{polls} health checks answered while the big request was handled"
    streamed = result["chunks"] - chunks_at_start
    assert streamed >= 3, f"the stream sent {streamed} chunks while the big request was handled"


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
