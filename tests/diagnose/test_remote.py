"""`llmpipe diagnose --base-url`: against a small fake OpenAI-compatible streaming server on loopback
whose delays are set by the test (the reference the client-side timings must reproduce).

Where a test checks the timings themselves, the server's delays are steps of a virtual clock that
the client reads, so the figures are exact on any machine, however busy."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmpipe.cli import main
from llmpipe.diagnose.analysis import diagnose
from llmpipe.diagnose.remote import RemoteServer, run_remote_probe


class SteppedClock:
    """Virtual time shared by one client and the fake server: the server advances it only once the
    client has read it since the last step, so each chunk arrives exactly at its scripted time."""

    def __init__(self) -> None:
        self.now = 0.0
        self._read = threading.Event()

    def __call__(self) -> float:
        now = self.now
        self._read.set()
        return now

    def advance(self, seconds: float) -> None:
        assert self._read.wait(60), "the client stopped reading"  # a hang guard, not a timing bound
        self._read.clear()
        self.now += seconds


class FakeCompletions(BaseHTTPRequestHandler):
    """/v1/models and streamed /v1/completions: `ttft` seconds to the first token, then `itl` per token."""

    ttft, itl = 0.1, 0.01
    clock: SteppedClock | None = None  # virtual delays instead of sleeps
    timing: dict | None = None  # an llmpipe_timing to put in the final chunk
    strict = False  # refuse unknown fields, as a strict server would
    bodies: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._send_json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if self.strict and "ignore_eos" in body:
            return self._send_json(400, {"error": {"message": "unknown field ignore_eos"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            self._wait(self.itl if i else self.ttft)
            self._event({"object": "text_completion", "choices": [{"index": 0, "text": f" w{i}"}]})
        final = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()),
                                          "completion_tokens": body["max_tokens"]}}
        if self.timing:
            final["llmpipe_timing"] = self.timing
        self._event(final)
        self.wfile.write(b"data: [DONE]\n\n")

    def _wait(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            time.sleep(seconds)

    def _event(self, data: dict) -> None:
        self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def _send_json(self, status: int, data: dict) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def fake_server():
    """Start a fake server with the given class attributes; yields its base URL maker."""
    servers = []

    def start(**attrs) -> str:
        handler = type("Handler", (FakeCompletions,), {"bodies": [], **attrs})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", handler

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_client_side_ttft_and_itl_reproduce_the_server_delays(fake_server):
    clock = SteppedClock()
    url, _ = fake_server(ttft=0.25, itl=0.02, clock=clock)
    workload, split = run_remote_probe(RemoteServer(url, clock=clock), "fake-model", 12, 20)
    assert workload.prompt_len == 12 and workload.output_len == 20  # from the final chunk's usage
    assert split.prefill_s == pytest.approx(0.25)
    assert split.mean_itl_s == pytest.approx(0.02) and split.max_itl_s == pytest.approx(0.02)
    assert split.decode_s == pytest.approx(19 * 0.02)
    assert split.overhead_s == pytest.approx(0)
    assert split.queue_s == 0  # unknown without the server's own split


def test_verdict_flips_with_the_server_behaviour(fake_server):
    clock = SteppedClock()
    slow_start, _ = fake_server(ttft=0.4, itl=0.005, clock=clock)
    slow_stream, _ = fake_server(ttft=0.02, itl=0.02, clock=clock)
    prefill = diagnose(*run_remote_probe(RemoteServer(slow_start, clock=clock), "fake-model", 200, 1))
    decode = diagnose(*run_remote_probe(RemoteServer(slow_stream, clock=clock), "fake-model", 8, 40))
    assert prefill.bound == "prefill-bound" and decode.bound == "decode-bound"
    assert decode.levers[0].name == "speculative decoding"


def test_server_timing_splits_queue_prefill_and_decode(fake_server):
    timing = {"queue_s": 0.05, "prefill_s": 0.1, "decode_s": 0.08, "ttft_s": 0.15, "mean_itl_s": 0.02,
              "output_tokens": 5}
    url, _ = fake_server(ttft=0.15, itl=0.02, timing=timing)
    workload, split = run_remote_probe(RemoteServer(url), "fake-model", 8, 5, batch=3)
    assert (split.queue_s, split.prefill_s, split.decode_s) == pytest.approx((0.05, 0.1, 0.08))
    # the rest of each client's wall time is HTTP and streaming (the sleeps make it at least zero)
    assert split.overhead_s >= 0
    assert workload.batch == 3


def test_a_server_refusing_ignore_eos_is_probed_without_it(fake_server):
    url, handler = fake_server(ttft=0.01, itl=0.001, strict=True)
    workload, _ = run_remote_probe(RemoteServer(url), "fake-model", 8, 4)
    assert workload.output_len == 4
    assert "ignore_eos" in handler.bodies[0] and "ignore_eos" not in handler.bodies[-1]


def test_diagnose_command_against_a_server(fake_server, capsys, tmp_path):
    url, handler = fake_server(ttft=0.02, itl=0.01)
    out = tmp_path / "remote.json"
    assert main(["diagnose", "--base-url", url, "--prompt-len", "16", "--output-len", "10", "--batch", "2",
                 "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fake-model at http://127.0.0.1" in text and "verdict: decode-bound" in text
    assert all(b["model"] == "fake-model" and b["stream"] for b in handler.bodies)  # discovered via /v1/models
    assert json.loads(out.read_text())["workload"]["batch"] == 2


@pytest.mark.parametrize("model", [["--model", "m"], []])  # with and without asking /v1/models
def test_unreachable_server_is_one_line(capsys, model):
    assert main(["diagnose", "--base-url", "http://127.0.0.1:9", *model]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("llmpipe: error: http://127.0.0.1:9")


def test_a_served_checkpoint_readable_here_gets_byte_figures(fake_server, capsys, tmp_path, tiny_checkpoint):
    url, _ = fake_server(ttft=0.02, itl=0.01)
    tiny = str(tiny_checkpoint("llama_gqa"))
    out = tmp_path / "remote.json"
    assert main(["diagnose", "--base-url", url, "--model", tiny, "--prompt-len", "16", "--output-len", "10",
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rates"]["decode_bytes_per_s"] > 0
    assert any("assume the server runs" in note for note in report["notes"])
