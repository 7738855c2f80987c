"""Helpers shared by the server tests and those that serve (bench, deploy, eval, docs): a live server on
a thread, `llmpipe serve` in a process of its own, an engine over a core process, waits that poll,
/metrics samples."""

from __future__ import annotations

import functools
import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import uvicorn

from llmpipe import LLM
from llmpipe.config import EngineConfig
from llmpipe.engine.core_client import ProcessCoreClient
from llmpipe.engine.encoder_core import serving_tokenizer
from llmpipe.server.app import create_app
from llmpipe.server.async_engine import AsyncEngine
from llmpipe.server.http import uvicorn_config

TINY_MODEL = "tiny"
# A paced server's engine steps take at least this long: a test that needs a request still running
# when something happens gets it by construction (a 1,000-token request runs for 50 s), not by
# hoping the machine is slow.
STEP_DELAY_S = 0.05
POLL_S = 0.05  # between a wait's checks: a wait never busy-loops a core that servers, Ray or the other test worker need
# A wait's only bound: long enough that no machine, however slow or loaded, reaches it unless something hangs.
HANG_GUARD_S = 600.0


def wait_until(condition, what: str, timeout: float = HANG_GUARD_S) -> None:
    """Wait for `condition()` to hold (readiness, checked every POLL_S); the timeout only catches a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} never happened (hung)"
        time.sleep(POLL_S)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_serve(process: subprocess.Popen, url: str) -> None:
    """Until the `llmpipe serve` process answers /health with 200 (wait_until's timeout: a hang guard)."""

    def ready() -> bool:
        assert process.poll() is None, "the server exited while starting"
        try:
            return httpx.get(f"{url}/health").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, "the server answering /health")


def serve_process(*args: str, stderr=subprocess.PIPE) -> tuple[subprocess.Popen, str]:
    """`llmpipe ARGS` (a serve command; its --port, if any, replaced by a free one) in a process of its
    own, once it answers /health: (the process, its base URL). The caller kills it (and reads or
    drains its stderr pipe, or passes a file)."""
    args, port = list(args), str(free_port())
    if "--port" in args:
        args[args.index("--port") + 1] = port
    else:
        args += ["--port", port]
    process = subprocess.Popen([sys.executable, "-m", "llmpipe.cli", *args], stderr=stderr, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_serve(process, url)
    except BaseException:
        process.kill()
        raise
    return process, url


def paced(delay: float = STEP_DELAY_S):
    """A `before_step` hook that makes every engine step last at least `delay` (picklable: it may run
    in the engine core process)."""
    return functools.partial(time.sleep, delay)


def core_process_engine(path: str, before_step=None, **options) -> AsyncEngine:
    """An AsyncEngine over an engine core process, as `llmpipe serve` builds it."""
    config = EngineConfig.from_kwargs(model=path, **options)
    return AsyncEngine(ProcessCoreClient(config, before_step), serving_tokenizer(path), max_waiting=512)


@contextmanager
def live_server(llm: LLM | AsyncEngine, model_name: str = TINY_MODEL, header_timeout: float = 30.0, **options) -> Iterator[str]:
    """Serve `llm` (its core on a thread) or an AsyncEngine (over a core process) until the block ends,
    with `llmpipe serve`'s app and HTTP layer; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    app = create_app(llm, model_name, **options)
    server = uvicorn.Server(uvicorn_config(app, header_timeout=header_timeout, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the server's start")
    assert server.started, "the server thread ended before it started serving"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=120)
        sock.close()


def metric(base_url: str, name: str, headers: dict | None = None) -> float:
    """One sample of /metrics, e.g. metric(url, 'llmpipe:kv_cache_usage_perc')."""
    text = httpx.get(f"{base_url}/metrics", headers=headers).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))
