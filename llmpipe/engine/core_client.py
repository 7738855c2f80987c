"""How a front end on an asyncio loop reaches the engine core: a thread of this process, or a process
of its own (`llmpipe serve`). Both take requests and aborts from the loop and call `on_step(outputs,
stats)` on the loop after every step; `on_death(reason)` if the core stops unasked.

Why a process: every PyTorch op releases and retakes the GIL, which the event loop, tokenizer,
detokenizer, pydantic and SSE formatting also want. In its own process the core steps as it does
offline, and the API server's work overlaps with it instead of interleaving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
from typing import Callable, Protocol

import zmq
import zmq.asyncio

from llmpipe.config import EngineConfig
from llmpipe.engine.core import EngineCore
from llmpipe.engine.core_messages import CoreInfo, EngineStats
from llmpipe.engine.core_loop import Command, CoreLoop, Stop
from llmpipe.engine.core_messages import Abort, CommandResult, EngineCoreOutputs, EngineCoreRequest, LoRACommand
from llmpipe.engine.core_process import (
    ABORT, ADD, DECODERS, FAILED, LORA, OUTPUTS, READY, REPLY, STOP, encoder, run_engine_core, stats_decoder,
)
from llmpipe.errors import LLMPipeError

logger = logging.getLogger(__name__)
OnStep = Callable[[EngineCoreOutputs, EngineStats], None]
OnDeath = Callable[[str], None]
STARTUP_POLL_MS = 200


class CoreClient(Protocol):
    info: CoreInfo
    stats: EngineStats  # the latest snapshot

    def start(self, on_step: OnStep, on_death: OnDeath) -> None: ...
    def add(self, request: EngineCoreRequest) -> None: ...
    def abort(self, targets: list[tuple[str, int | None]]) -> None: ...
    async def stop(self, timeout: float) -> None: ...
    # Optional: `async def lora(action, name, path=None) -> CommandResult` (a LoRA load or unload between steps).

    @property
    def alive(self) -> bool: ...


class ThreadCoreClient:
    """The core on a thread of this process (an `LLM`'s engine behind `create_app`: tests, embedding)."""

    def __init__(self, core: EngineCore, before_step: Callable[[], None] | None = None) -> None:
        self.core = core
        self.info = core.info(os.getpid())
        self.stats = core.stats()
        self._before_step = before_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._replies = _Replies()

    def start(self, on_step: OnStep, on_death: OnDeath) -> None:
        loop = asyncio.get_running_loop()
        transport = _ThreadTransport(self._commands, loop, on_step, self._replies.resolve)
        loop_ = CoreLoop(self.core, transport, self._before_step)

        def run() -> None:
            try:
                loop_.run()
            except BaseException as err:  # noqa: BLE001 - reported to the front end, which fails its requests
                logger.exception("the engine thread died")
                reason = f"the engine thread died ({type(err).__name__})"
                loop.call_soon_threadsafe(self._replies.fail, reason)
                loop.call_soon_threadsafe(on_death, reason)

        self._thread = threading.Thread(target=run, name="llmpipe-engine", daemon=True)
        self._thread.start()

    def add(self, request: EngineCoreRequest) -> None:
        self._commands.put(request)

    def abort(self, targets: list[tuple[str, int | None]]) -> None:
        self._commands.put(Abort(targets))

    async def lora(self, action: str, name: str, path: str | None = None) -> CommandResult:
        command, reply = self._replies.new(action, name, path)
        self._commands.put(command)
        return await reply

    async def stop(self, timeout: float) -> None:
        if self._thread is not None:
            self._commands.put(Stop())
            await asyncio.to_thread(self._thread.join, timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class _Replies:
    """The LoRA commands sent and not yet answered: a future each, by command id, resolved on the loop."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}

    def new(self, action: str, name: str, path: str | None) -> tuple[LoRACommand, asyncio.Future]:
        command = LoRACommand(next(self._ids), action, name, path)
        future = self._waiting[command.command_id] = asyncio.get_running_loop().create_future()
        return command, future

    def resolve(self, result: CommandResult) -> None:
        future = self._waiting.pop(result.command_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def fail(self, reason: str) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(LLMPipeError(reason))
        self._waiting.clear()


class _ThreadTransport:
    def __init__(self, commands: queue.SimpleQueue, loop: asyncio.AbstractEventLoop, on_step: OnStep,
                 on_reply: Callable[[CommandResult], None]) -> None:
        self.commands, self.loop, self.on_step, self.on_reply = commands, loop, on_step, on_reply

    def should_run(self) -> bool:
        return not self.loop.is_closed()

    def receive(self, timeout_s: float) -> list[Command | Stop]:
        received = []
        try:
            received.append(self.commands.get(timeout=timeout_s) if timeout_s else self.commands.get_nowait())
            while True:
                received.append(self.commands.get_nowait())
        except queue.Empty:
            return received

    def send(self, step: EngineCoreOutputs, stats: EngineStats) -> None:
        self.loop.call_soon_threadsafe(self.on_step, step, stats)

    def reply(self, result: CommandResult) -> None:
        self.loop.call_soon_threadsafe(self.on_reply, result)


class ProcessCoreClient:
    """The core in a process of its own, over ZeroMQ ipc sockets (see `core_process`).

    Construction starts the process and waits until the model is loaded: a load failure is raised
    here with the core's own message. `before_step`, if given, must be picklable (it runs in the
    core process)."""

    def __init__(self, config: EngineConfig, before_step: Callable[[], None] | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="llmpipe-core-")
        self._context = zmq.Context()
        self._inputs, self._outputs = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        self._inputs.setsockopt(zmq.LINGER, 0)
        input_address, output_address = f"ipc://{self._dir}/inputs", f"ipc://{self._dir}/outputs"
        self._inputs.bind(input_address)
        self._outputs.bind(output_address)
        spawn = multiprocessing.get_context("spawn")  # a clean interpreter: no threads or locks forked mid-use
        self.process = spawn.Process(
            target=run_engine_core, name="llmpipe-engine-core",
            args=(config, input_address, output_address, os.getpid(), before_step),
        )
        self._dead: str | None = None
        self._stopping = False
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._replies = _Replies()
        self.process.start()
        try:
            self.info: CoreInfo = self._wait_for(READY)
            self.stats: EngineStats = self._wait_for(OUTPUTS)
        except BaseException:
            self.close(timeout=0)  # a core still loading has nothing to finish: SIGTERM at once
            raise

    def _wait_for(self, kind: bytes):
        """The next message of `kind` from a core that is starting; its load error if it failed."""
        while not self._outputs.poll(STARTUP_POLL_MS):
            if not self.process.is_alive():
                raise LLMPipeError(f"the engine core process exited while loading (exit code {self.process.exitcode})")
        frames = self._outputs.recv_multipart()
        if frames[0] == FAILED:
            raise LLMPipeError(frames[1].decode())
        if frames[0] != kind:
            raise LLMPipeError(f"the engine core sent {frames[0]!r} while starting, not {kind!r}")
        return stats_decoder.decode(frames[2]) if kind == OUTPUTS else DECODERS[kind].decode(frames[1])

    def start(self, on_step: OnStep, on_death: OnDeath) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read(zmq.asyncio.Socket.from_socket(self._outputs), on_step))
        self._loop.add_reader(self.process.sentinel, self._exited, on_death)

    async def _read(self, outputs: zmq.asyncio.Socket, on_step: OnStep) -> None:
        decode = DECODERS[OUTPUTS].decode
        try:
            while True:
                frames = await outputs.recv_multipart()
                if frames[0] == OUTPUTS:
                    self.stats = stats_decoder.decode(frames[2])
                    on_step(decode(frames[1]), self.stats)
                elif frames[0] == REPLY:
                    self._replies.resolve(DECODERS[REPLY].decode(frames[1]))
        except zmq.ZMQError:  # closed: the client is stopping
            return

    def _exited(self, on_death: OnDeath) -> None:
        self._loop.remove_reader(self.process.sentinel)
        if self._stopping:
            return
        self.process.join(1)
        self._dead = f"the engine core process died (exit code {self.process.exitcode})"
        logger.error("%s", self._dead)
        self._replies.fail(self._dead)
        on_death(self._dead)

    def add(self, request: EngineCoreRequest) -> None:
        self._send(ADD, encoder.encode(request))

    def abort(self, targets: list[tuple[str, int | None]]) -> None:
        self._send(ABORT, encoder.encode(Abort(targets)))

    async def lora(self, action: str, name: str, path: str | None = None) -> CommandResult:
        command, reply = self._replies.new(action, name, path)
        self._send(LORA, encoder.encode(command))
        return await reply

    def _send(self, kind: bytes, payload: bytes) -> None:
        if self._dead:
            raise LLMPipeError(self._dead)
        try:
            self._inputs.send_multipart([kind, payload], flags=zmq.NOBLOCK)
        except zmq.Again as err:  # no core connected, or it stopped reading
            raise LLMPipeError("the engine core is not taking requests") from err

    async def stop(self, timeout: float) -> None:
        if self._reader is not None:  # on the loop, before its socket closes under it
            self._reader.cancel()
        await asyncio.to_thread(self.close, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the core (asking first, then SIGTERM, then SIGKILL) and release the sockets."""
        if self._stopping:
            return
        self._stopping = True
        if self.process.is_alive():
            try:
                self._inputs.send_multipart([STOP, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if self._reader is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._reader.cancel)
        self._context.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self._dead is None and self.process.is_alive()
