"""GrammarSandbox: the front end's worker processes that check untrusted constraints
(structured_output/worker.py), so that no constraint can crash, stall or hold the GIL of the server;
check_structured_outputs, the check at admission (a 400 naming the field, before the request
reaches the engine core).

A check that the worker answers is its verdict; a worker that dies (a native stack overflow, memory
past its bound) or outlasts the deadline is killed and replaced, and that constraint alone is
refused. Verdicts are cached by constraint, so a repeated schema is checked once.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from llmpipe.errors import InvalidRequestError
from llmpipe.sampling_params import StructuredOutputsParams
from llmpipe.structured_output.grammar import CHECK_STACK_BYTES, GrammarKey, grammar_key

logger = logging.getLogger(__name__)
COMPILE_TIMEOUT_S = 10.0
WORKERS = 2
CACHE_SIZE = 512


@dataclass(frozen=True)
class Verdict:
    problem: str | None  # why the constraint is refused; None: it compiles and can run
    lark: str | None = None  # a grammar's Lark text


class WorkerDied(Exception):
    pass


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, stack_bytes: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llmpipe.structured_output.worker", str(stack_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=_worker_env(),
        )
        self._pending = b""

    def ask(self, key: GrammarKey, timeout_s: float) -> dict:
        """The worker's reply; TimeoutError past timeout_s, WorkerDied if it exits first."""
        try:
            self.process.stdin.write(json.dumps(key).encode() + b"\n")
        except (BrokenPipeError, OSError) as err:
            raise WorkerDied(str(err)) from None
        return json.loads(self._read_line(time.monotonic() + timeout_s))

    def _read_line(self, deadline: float) -> bytes:
        fd = self.process.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._pending:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise TimeoutError
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise WorkerDied(f"exit status {self.process.wait()}")
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            pipe.close()


def _worker_env() -> dict[str, str]:
    """The worker imports llmpipe from wherever this process did."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


class GrammarSandbox:
    """Checks constraints in up to `workers` worker processes, each check at most `timeout_s`, each
    compile on a thread of `stack_bytes` (the engine core's compile threads have twice the default)."""

    def __init__(self, workers: int = WORKERS, timeout_s: float = COMPILE_TIMEOUT_S,
                 stack_bytes: int = CHECK_STACK_BYTES) -> None:
        self.timeout_s = timeout_s
        self.stack_bytes = stack_bytes
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(workers):
            self._idle.put(None)  # a slot: its worker starts on first use
        self._verdicts: OrderedDict[GrammarKey, Verdict] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, key: GrammarKey) -> Verdict:
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        verdict, lasting = self._run(key)
        if lasting:
            self.remember(key, verdict)
        return verdict

    def remember(self, key: GrammarKey, verdict: Verdict) -> None:
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > CACHE_SIZE:
                self._verdicts.popitem(last=False)

    def _run(self, key: GrammarKey) -> tuple[Verdict, bool]:
        """(verdict, whether it holds for good: a timeout depends on the machine's load)."""
        try:
            worker = self._idle.get(timeout=self.timeout_s) or _Worker(self.stack_bytes)
        except queue.Empty:
            return Verdict("the grammar checker is busy; try again"), False
        try:
            reply = worker.ask(key, self.timeout_s)
        except TimeoutError:
            worker.kill()
            self._idle.put(None)
            return Verdict(f"it did not compile within {self.timeout_s:g} s"), False
        except (WorkerDied, ValueError) as err:
            worker.kill()
            self._idle.put(None)
            logger.warning("a grammar check crashed its worker (%s); another starts", err)
            return Verdict("compiling it crashed the compiler (too deep or too large)"), True
        self._idle.put(worker)
        return Verdict(reply["problem"], reply.get("lark")), True

    def start(self) -> None:
        """Start every worker now (a server's start), so no request waits for one to start."""
        slots = []
        while True:
            try:
                slots.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for worker in slots:
            self._idle.put(worker or _Worker(self.stack_bytes))

    def close(self) -> None:
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


_sandbox: GrammarSandbox | None = None
_sandbox_lock = threading.Lock()


def grammar_sandbox() -> GrammarSandbox:
    """The process's sandbox, made on first use and closed at exit."""
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            _sandbox = GrammarSandbox()
            atexit.register(_sandbox.close)
        return _sandbox


def check_structured_outputs(spec: StructuredOutputsParams | None, field: str | None = None) -> StructuredOutputsParams | None:
    """The constraint as the engine core should get it, checked in the sandbox: a bad regex, an
    invalid or unsatisfiable schema, a grammar that does not parse, matches nothing or can never end,
    one past a bound or that crashes or outlasts the compiler are InvalidRequestError naming `field`
    (default `structured_outputs.<kind>`). A GBNF grammar comes back as its Lark form, so that the
    core does not convert it again."""
    if spec is None:
        return None
    key = grammar_key(spec)
    sandbox = grammar_sandbox()
    verdict = sandbox.check(key)
    if verdict.problem is not None:
        field = field or f"structured_outputs.{key[0]}"
        raise InvalidRequestError(f"{field}: invalid {_WHAT[key[0]]}: {verdict.problem}", param=field)
    if verdict.lark is None or verdict.lark == spec.grammar:
        return spec
    converted = replace(spec, grammar=verdict.lark)
    sandbox.remember(grammar_key(converted), verdict)  # its Lark form passed too: admission need not ask again
    return converted


_WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}
