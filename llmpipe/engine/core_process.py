"""The engine core in a process of its own: `llmpipe serve`'s model, KV cache and scheduler.

It talks to the API server over two ZeroMQ PUSH/PULL pipes (ipc sockets) with msgpack messages
(msgspec, typed): requests, aborts and LoRA loads in; "ready", each step's outputs with the engine's
stats, LoRA loads' outcomes, or a fatal load error out. It exits when told to stop, on SIGTERM, or as soon as it sees that the
API server died (its parent changed), so it never outlives the server.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Callable

import msgspec
import zmq

from llmpipe.config import EngineConfig
from llmpipe.engine.encoder_core import engine_core
from llmpipe.engine.core_messages import CoreInfo, EngineStats
from llmpipe.engine.core_loop import Command, CoreLoop, Stop
from llmpipe.engine.core_messages import Abort, CommandResult, EngineCoreOutputs, EngineCoreRequest, LoRACommand

# Message kinds: the first frame of every two-frame message.
ADD, ABORT, STOP, LORA = b"add", b"abort", b"stop", b"lora"  # API server → core
READY, OUTPUTS, FAILED, REPLY = b"ready", b"outputs", b"failed", b"reply"  # core → API server

encoder = msgspec.msgpack.Encoder()
DECODERS = {
    ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    ABORT: msgspec.msgpack.Decoder(Abort),
    READY: msgspec.msgpack.Decoder(CoreInfo),
    OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
    LORA: msgspec.msgpack.Decoder(LoRACommand),
    REPLY: msgspec.msgpack.Decoder(CommandResult),
}
stats_decoder = msgspec.msgpack.Decoder(EngineStats)


def run_engine_core(
    config: EngineConfig, input_address: str, output_address: str, parent_pid: int,
    before_step: Callable[[], None] | None = None,
) -> None:
    """The core process's main function (a multiprocessing "spawn" target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API server decides
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(level=logging.WARNING, format="llmpipe engine core: %(levelname)s %(message)s")
    context = zmq.Context()
    transport = ZmqTransport(context, input_address, output_address, parent_pid)
    try:
        core = engine_core(config)
    except Exception as err:  # a bad path, a corrupt file, an unsupported architecture: one line for the CLI
        transport.outputs.send_multipart([FAILED, str(err).encode()])
        # The API server terminates a core that failed as soon as it reads why: a SIGTERM inside
        # destroy's linger must end the process quietly, not raise SystemExit through a socket's __del__.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        context.destroy(linger=2000)
        raise SystemExit(1) from None
    core.fault_in()  # a server lives long: its start-up pays the page faults, not its requests
    try:
        transport.outputs.send_multipart([READY, encoder.encode(core.info(os.getpid()))])
        transport.send(EngineCoreOutputs([], 0.0), core.stats())
        CoreLoop(core, transport, before_step).run()
    finally:
        core.close()
        context.destroy(linger=2000)


class ZmqTransport:
    def __init__(self, context: zmq.Context, input_address: str, output_address: str, parent_pid: int) -> None:
        self.inputs, self.outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        self.inputs.connect(input_address)
        self.outputs.connect(output_address)
        self.parent_pid = parent_pid

    def should_run(self) -> bool:
        if os.getppid() == self.parent_pid:
            return True
        logging.getLogger(__name__).warning("the API server (pid %d) is gone; exiting", self.parent_pid)
        return False

    def receive(self, timeout_s: float) -> list[Command | Stop]:
        commands: list[Command | Stop] = []
        while self.inputs.poll(int(timeout_s * 1000) if not commands else 0):
            kind, payload = self.inputs.recv_multipart()
            commands.append(Stop() if kind == STOP else DECODERS[kind].decode(payload))
        return commands

    def send(self, step: EngineCoreOutputs, stats: EngineStats) -> None:
        self.outputs.send_multipart([OUTPUTS, encoder.encode(step), encoder.encode(stats)])

    def reply(self, result: CommandResult) -> None:
        self.outputs.send_multipart([REPLY, encoder.encode(result)])
