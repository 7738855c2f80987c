"""`llmpipe serve` on SIGTERM / SIGINT: a request that finishes within --shutdown-timeout finishes; one
that would not gets an error event and [DONE]; while it drains, the server still answers, with 503s
(/health included) a load balancer can see; the process exits 0 without a traceback.

The server runs paced (each engine step takes at least STEP_DELAY_S), so the long request cannot
finish within the drain on any machine, and the short one has seconds to spare."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.utils import STEP_DELAY_S, free_port, wait_for_serve

SHUTDOWN_TIMEOUT_S = 4  # the short request's 8 tokens need ~0.4 s of it; the long one's 1,000 need 50 s
# `llmpipe serve`, with each engine step paced by a sleep (picklable: it runs in the core process)
PACED_SERVE = f"""
import functools, sys, time
from llmpipe.cli import build_parser
from llmpipe.server.cli import run_serve
run_serve(build_parser().parse_args(sys.argv[1:]), before_step=functools.partial(time.sleep, {STEP_DELAY_S}))
"""


def stream(url: str, max_tokens: int, started: threading.Event, events: list) -> None:
    body = {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                started.set()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_shutdown_finishes_short_requests_and_ends_long_ones_cleanly(tiny_path, sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--model", tiny_path, "--port", str(port), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    server = subprocess.Popen([sys.executable, "-c", PACED_SERVE, *args], stderr=subprocess.PIPE, text=True)
    try:
        wait_for_serve(server, url)
        streams = {"short": (8, threading.Event(), []), "long": (1000, threading.Event(), [])}
        threads = [threading.Thread(target=stream, args=(url, *s)) for s in streams.values()]
        for t in threads:
            t.start()
        for _, started, _ in streams.values():
            assert started.wait(60)
        server.send_signal(sig)
        health = wait_for_health(url, 503)  # answered, not refused: the drain is visible
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        for t in threads:
            t.join(timeout=60)
        assert server.wait(timeout=60) == 0
    finally:
        server.kill()
    stderr = server.stderr.read()
    assert "Traceback" not in stderr, stderr
    short, long = streams["short"][2], streams["long"][2]
    assert short[-1] == long[-1] == "[DONE]"
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    error = json.loads(long[-2])["error"]
    assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
    assert "shutting down" in health.json()["error"]["message"]
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]


def wait_for_health(url: str, status: int) -> httpx.Response:
    deadline = time.monotonic() + 60  # a hang guard
    while True:
        response = httpx.get(f"{url}/health", timeout=60)
        if response.status_code == status:
            return response
        assert time.monotonic() < deadline, f"/health never answered {status}"
        time.sleep(0.02)


# `llmpipe serve` whose model load signals its own process, as a Ctrl-C or a supervisor's SIGTERM
# would while it loads; SIGINT comes in ignored, as a script's background job (`cmd &`) inherits it.
INTERRUPTED_WHILE_LOADING = """
import os, signal, sys
import llmpipe.loader
from llmpipe.cli import main
signal.signal(signal.SIGINT, signal.SIG_IGN)
def loading(path):
    os.kill(os.getpid(), int(os.environ["SIGNAL"]))
    signal.pause()  # where the signal went unheard, loading never ends (the test's timeout ends it)
llmpipe.loader.load_checkpoint = loading
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_loading_stops_the_server_at_once(tiny_path, sig):
    args = ["serve", "--model", tiny_path, "--port", str(free_port())]
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_WHILE_LOADING, *args], capture_output=True, text=True,
                          env={**os.environ, "SIGNAL": str(int(sig))}, timeout=50)
    assert done.returncode == 130 and done.stderr.strip().splitlines()[-1] == "llmpipe: interrupted", done.stderr
    assert "Traceback" not in done.stderr
