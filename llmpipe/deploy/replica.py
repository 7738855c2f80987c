"""One data-parallel rank as a Ray Serve deployment: an engine core (model, KV cache, scheduler) in a
process of the replica's actor. Token ids cross, never text, as between `llmpipe serve`'s API server
and its core process: `add` and `abort` in, and a stream of every step's outputs and stats out (`steps`)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import msgspec

from llmpipe.config import EngineConfig
from llmpipe.engine.core_messages import CoreInfo, EngineStats
from llmpipe.engine.core_client import ProcessCoreClient
from llmpipe.engine.core_messages import EngineCoreOutputs, EngineCoreRequest


class ReplicaStep(msgspec.Struct, array_like=True):
    """A step's outputs and the replica's stats after it; `died` set once its engine stopped."""

    outputs: EngineCoreOutputs
    stats: EngineStats
    died: str | None = None


encoder = msgspec.msgpack.Encoder()
info_decoder = msgspec.msgpack.Decoder(CoreInfo)
step_decoder = msgspec.msgpack.Decoder(ReplicaStep)
request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)


class EngineReplica:
    def __init__(self, engine_kwargs: dict, before_step: Callable[[], None] | None = None) -> None:
        """`engine_kwargs`: EngineConfig's fields; `before_step` as CoreLoop's (tests pace the engine)."""
        # The core in a process of its own, as `llmpipe serve` runs it: its PyTorch ops do not contend
        # for this actor's GIL with Ray's messaging (that costed ~15% of c1 ITL with the core on a thread).
        self.client = ProcessCoreClient(EngineConfig.from_kwargs(**engine_kwargs), before_step)
        self.stats = self.client.stats
        self.dead: str | None = None
        self._started = False
        self._subscribers: set[asyncio.Queue] = set()

    def _start(self) -> None:
        """On the actor's event loop, at the first call that needs the engine running."""
        if not self._started:
            self.client.start(self._on_step, self._on_death)
            self._started = True

    def _on_step(self, outputs: EngineCoreOutputs, stats: EngineStats) -> None:
        self.stats = stats
        self._publish(ReplicaStep(outputs, stats))

    def _on_death(self, reason: str) -> None:
        self.dead = reason
        self._publish(ReplicaStep(EngineCoreOutputs([], 0.0), self.stats, died=reason))

    def _publish(self, step: ReplicaStep) -> None:
        payload = encoder.encode(step)
        for queue in self._subscribers:
            queue.put_nowait(payload)

    async def info(self) -> bytes:
        return encoder.encode(self.client.info)

    async def add(self, request: bytes) -> None:
        self._start()
        self.client.add(request_decoder.decode(request))

    async def abort(self, targets: list[tuple[str, int | None]]) -> None:
        self.client.abort([tuple(t) for t in targets])

    async def steps(self) -> AsyncIterator[bytes]:
        """Every step from now on (first a snapshot of the stats), until `close`: what a front end follows."""
        self._start()
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            yield encoder.encode(ReplicaStep(EngineCoreOutputs([], 0.0), self.stats, died=self.dead))
            while self.dead is None and (payload := await queue.get()) is not None:
                yield payload
        finally:
            self._subscribers.discard(queue)

    async def close(self) -> None:
        """End the step streams: Serve's graceful shutdown waits for every call in progress, and a
        front end that is itself stopping has nothing left to follow."""
        for queue in self._subscribers:
            queue.put_nowait(None)

    def check_health(self) -> None:
        """Ray Serve's probe: a replica whose engine died is restarted."""
        if self.dead is not None:
            raise RuntimeError(self.dead)
