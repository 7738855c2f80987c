"""AsyncEngine: one thread steps the LLMEngine; each request reads its outputs from an asyncio queue.

The engine is not thread-safe, so only the engine thread touches it: the event loop sends it
commands (add, abort) through a queue, and it hands each step's outputs back through
call_soon_threadsafe. A step runs off the event loop, so HTTP stays responsive while it computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from llmpipe.engine.engine import EngineStats, LLMEngine, PromptInput
from llmpipe.errors import LLMPipeError
from llmpipe.outputs import RequestOutput
from llmpipe.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
DRAIN_POLL_S = 0.05


class UnavailableError(LLMPipeError):
    """The waiting queue is full, or the server is shutting down (HTTP 503)."""


class RequestFailedError(LLMPipeError):
    """The engine failed this request (a server-side fault, not the client's)."""


class RequestStream:
    """One request's outputs, in order, as the engine produces them."""

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self.finished = False
        self.num_tokens = 0  # generated tokens already counted (for the metrics)
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def abort(self) -> None:
        """Free the request's KV blocks at the engine's next turn (a no-op once it finished)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting: int | None = None,
        on_output: Callable[[RequestStream, RequestOutput], None] | None = None,
        before_step: Callable[[], None] | None = None,
    ) -> None:
        """`before_step` runs on the engine thread before every step: tests pace the engine with it
        (a request that must still be running when something happens), instrumentation counts steps."""
        self.engine = engine
        self.max_waiting = max_waiting
        self.stats: EngineStats = engine.stats()  # a snapshot, refreshed by the engine thread
        self._on_output = on_output
        self._before_step = before_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds = 0
        self._closing = False
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side ------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="llmpipe-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running and join the engine thread."""
        if self._thread is None:
            return
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join, timeout)
        self._abort_all("the server is shutting down")
        self._thread = None

    def drain(self, timeout: float, on_drained: Callable[[], None] | None = None) -> None:
        """Shutdown has begun: refuse new requests (503), give the running ones `timeout` seconds,
        end what is left, then call `on_drained`."""
        self._closing = True
        deadline = self._loop.time() + timeout

        def check() -> None:
            if self._streams and self._loop.time() < deadline:
                self._loop.call_later(DRAIN_POLL_S, check)
                return
            self._abort_all("the server is shutting down")
            if on_drained is not None:
                on_drained()

        check()

    def drain_threadsafe(self, timeout: float, on_drained: Callable[[], None] | None = None) -> None:
        self._loop.call_soon_threadsafe(self.drain, timeout, on_drained)

    @property
    def closing(self) -> bool:
        return self._closing

    def _abort_all(self, reason: str) -> None:
        for stream in list(self._streams.values()):
            stream.put(UnavailableError(reason))
            self.abort(stream.request_id)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._pending_adds + self.stats.num_waiting

    async def add(self, prompt: PromptInput, params: SamplingParams) -> RequestStream:
        """Queue a request; raises InvalidRequestError (from the engine) or UnavailableError."""
        if self._closing:
            raise UnavailableError("the server is shutting down")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise UnavailableError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
        stream = RequestStream(f"req-{next(self._ids)}", self)
        self._streams[stream.request_id] = stream
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._pending_adds += 1
        self._commands.put(("add", stream.request_id, prompt, params, added))
        try:
            await asyncio.wrap_future(added)
        except BaseException:  # refused, or the client left while it was queued
            self._streams.pop(stream.request_id, None)
            stream.abort()
            raise
        finally:
            self._pending_adds -= 1
        return stream

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id))

    def _dispatch(self, outputs: list[RequestOutput], failed: BaseException | None) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if self._on_output is not None:
                self._on_output(stream, output)
            error = failed or _request_error(output)
            stream.put(error or output)
            if output.finished or error:
                del self._streams[output.request_id]

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        while self._drain_commands(block=not self.engine.has_unfinished_requests()):
            if self.engine.has_unfinished_requests():
                if self._before_step is not None:
                    self._before_step()
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
            self.stats = self.engine.stats()  # before the outputs: a client that saw a token sees its step's stats
            self._post(outputs, None)
        except Exception as err:  # a batch-level fault: fail what is running, keep serving
            logger.exception("engine step failed; failing the requests in flight")
            outputs = [request.to_output() for request in self.engine.requests.values()]
            for output in outputs:
                self.engine.abort_request(output.request_id)
            self.stats = self.engine.stats()
            failed = RequestFailedError(f"the engine's step failed ({type(err).__name__}); see the server log")
            self._post(outputs, failed)

    def _post(self, outputs: list[RequestOutput], failed: BaseException | None) -> None:
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs, failed)

    def _drain_commands(self, block: bool) -> bool:
        """Run every queued command (waiting for one when idle); False once told to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                for request_id in list(self.engine.requests):
                    self.engine.abort_request(request_id)
                return False
            self._run_command(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self.stats = self.engine.stats()
                return True

    def _run_command(self, command: tuple) -> None:
        if command[0] == "abort":
            self.engine.abort_request(command[1])
            return
        _, request_id, prompt, params, added = command
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as err:
            added.set_exception(err)
        else:
            added.set_result(None)


def _request_error(output: RequestOutput) -> RequestFailedError | None:
    failed = [choice for choice in output.outputs if choice.finish_reason == "error"]
    if output.finished and failed:
        return RequestFailedError(f"{failed[0].error or 'the engine failed this request'}; see the server log")
    return None
