"""CoreLoop: what runs the engine core, in a thread or in its own process, behind a transport.

While the core has requests it steps without waiting, applying the commands (requests, aborts, LoRA loads)
that arrived meanwhile before each step; idle, it waits for the next command. A LoRA load's file is read on
a thread of its own (a large adapter takes seconds: the streams keep stepping meanwhile), and the adapter
goes into its slot between two steps once read. After every step,
and after commands that changed the core's state, it hands the outputs and the core's stats to
the transport. A step whose batch faults fails the requests in flight and the loop goes on.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

from llmpipe.engine.core import EngineCore
from llmpipe.engine.core_messages import EngineStats
from llmpipe.engine.core_messages import (Abort, CommandResult, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                          LoRACommand)

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # an idle loop wakes this often to check that it should still run
READ_WAIT_S = 0.01  # ... and this often while a LoRA adapter's file is being read

Command = EngineCoreRequest | Abort | LoRACommand


class Stop:
    """The command that ends the loop (aborting whatever still runs)."""


class Transport(Protocol):
    def receive(self, timeout_s: float) -> list[Command | Stop]:
        """Commands that arrived, waiting up to timeout_s for the first (0: none)."""

    def send(self, step: EngineCoreOutputs, stats: EngineStats) -> None: ...

    def reply(self, result: CommandResult) -> None:
        """A LoRA command's outcome, to the client that is waiting for it."""

    def should_run(self) -> bool:
        """False once the loop's owner is gone (the API server died)."""


class CoreLoop:
    def __init__(self, core: EngineCore, transport: Transport, before_step: Callable[[], None] | None = None) -> None:
        """`before_step` runs before every step: tests pace the engine with it (a request that must
        still be running when something happens)."""
        self.core = core
        self.transport = transport
        self.before_step = before_step
        self.reading: list[tuple[LoRACommand, Future]] = []  # LoRA loads whose files are being read
        self._reader: ThreadPoolExecutor | None = None

    def run(self) -> None:
        try:
            self._run()
        finally:
            if self._reader is not None:
                self._reader.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while self.transport.should_run():
            idle_wait = READ_WAIT_S if self.reading else IDLE_WAIT_S
            commands = self.transport.receive(0 if self.core.has_unfinished_requests() else idle_wait)
            if not self._apply(commands):
                break
            loaded = self._finish_reads()
            if self.core.has_unfinished_requests():
                if self.before_step is not None:
                    self.before_step()
                self.transport.send(self.core.step_guarded(), self.core.stats())
            elif commands or loaded:  # admissions, aborts or loads changed the stats a client may read
                self.transport.send(EngineCoreOutputs([], 0.0), self.core.stats())
        for request_id in list(self.core.requests):
            self.core.abort(request_id)

    def _apply(self, commands: list[Command | Stop]) -> bool:
        """Run the commands in order; False on Stop."""
        for command in commands:
            if isinstance(command, Stop):
                return False
            if isinstance(command, Abort):
                for request_id, index in command.targets:
                    self.core.abort(request_id, index)
            elif isinstance(command, LoRACommand):
                self._lora(command)
            else:
                self._add(command)
        return True

    def _lora(self, command: LoRACommand) -> None:
        """An unload now (between steps: no forward is using the slots); a load's file read off the step first."""
        apply = getattr(self.core, "lora_command", None)
        if apply is None:
            self.transport.reply(CommandResult(command.command_id, 400, "this model serves no LoRA adapters"))
        elif command.action == "load":
            self._reader = self._reader or ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-read")
            self.reading.append((command, self._reader.submit(self.core.loras.read, command.name, command.path)))
        else:
            self.transport.reply(apply(command))

    def _finish_reads(self) -> bool:
        """The loads whose files are read: into their slots, and answered. Whether any finished."""
        done = [(command, future) for command, future in self.reading if future.done()]
        for command, future in done:
            self.reading.remove((command, future))
            self.transport.reply(self.core.lora_command(command, future.result))
        return bool(done)

    def _add(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
        except Exception as err:  # the front end checked admission first: fail this request alone
            logger.exception("request %s refused by the engine core", request.request_id)
            error = f"the engine refused the request: {err}"
            outputs = [EngineCoreOutput(request.request_id, i, [], finish_reason="error", error=error)
                       for i in range(request.params.n)]
            self.transport.send(EngineCoreOutputs(outputs, 0.0), self.core.stats())
