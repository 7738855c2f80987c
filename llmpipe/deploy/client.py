"""The ingress's CoreClient over N data-parallel engine replicas (Ray Serve deployments): it routes each
request to one replica (router.py), follows every replica's step stream, and hands the outputs of its
own requests to the AsyncEngine in front, so routes, detokenization, stop strings, streaming and
metrics are the single server's.

A replica that dies fails only its own requests in flight (an error output each: an error event on a
stream, a 500 otherwise); it takes no new requests until Ray Serve has restarted it and its step
stream answers again, when it rejoins with an empty prefix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Sequence

from llmpipe.engine.core_messages import CoreInfo, EngineStats
from llmpipe.engine.core_client import OnDeath, OnStep
from llmpipe.engine.core_messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from llmpipe.deploy.replica import encoder, info_decoder, step_decoder
from llmpipe.deploy.router import NoReplicaError, Router
from llmpipe.errors import LLMPipeError

logger = logging.getLogger(__name__)
REJOIN_WAIT_S = 1.0  # between attempts to follow a replica that is down


@dataclasses.dataclass
class _Owned:
    replica: int
    samples: int


class DataParallelCoreClient:
    def __init__(self, handles: Sequence[Any], infos: Sequence[CoreInfo], stats: Sequence[EngineStats],
                 router: Router) -> None:
        """handles: one Ray Serve DeploymentHandle per replica; infos and stats: their first answers
        (see `connect` / `aconnect`)."""
        self.handles, self.router = list(handles), router
        self.info = infos[0]
        self.replica_stats: list[EngineStats | None] = list(stats)
        self._up = [True] * len(self.handles)
        self._owned: dict[str, _Owned] = {}
        self._loads = [0] * len(self.handles)
        self._cache_blocks = [0] * len(self.handles)  # each replica's KV cache, as its stats last said
        self._tasks: list[asyncio.Task] = []
        self._on_step: OnStep | None = None
        self._stopping = False

    @classmethod
    def connect(cls, handles: Sequence[Any], router) -> "DataParallelCoreClient":
        """From a thread with no running event loop (the CLI): waits for every replica's first answer."""
        infos = [info_decoder.decode(h.info.remote().result()) for h in handles]
        return cls(handles, infos, [None] * len(handles), router)

    @classmethod
    async def aconnect(cls, handles: Sequence[Any], router) -> "DataParallelCoreClient":
        infos = [info_decoder.decode(await h.info.remote()) for h in handles]
        return cls(handles, infos, [None] * len(handles), router)

    # ---- CoreClient ---------------------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        return merge_stats([s for s in self.replica_stats if s is not None]) or _EMPTY

    @property
    def alive(self) -> bool:
        return not self._stopping

    def start(self, on_step: OnStep, on_death: OnDeath) -> None:
        """Replicas come and go (Ray Serve restarts them); the client itself never dies, so on_death is unused."""
        self._on_step = on_step
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow(i)) for i in range(len(self.handles))]

    def add(self, request: EngineCoreRequest) -> None:
        loads = [load if up else None for load, up in zip(self._loads, self._up)]
        try:
            replica = self.router.choose(request.prompt_token_ids, loads)
        except NoReplicaError as err:
            raise LLMPipeError(str(err)) from err
        self._owned[request.request_id] = _Owned(replica, request.params.n)
        self._loads[replica] += 1
        call = self.handles[replica].add.remote(encoder.encode(request))
        asyncio.get_running_loop().create_task(self._confirm(call, request.request_id))

    def abort(self, targets: list[tuple[str, int | None]]) -> None:
        by_replica: dict[int, list[tuple[str, int | None]]] = {}
        for request_id, index in targets:
            owned = self._owned.get(request_id)
            if owned is not None:
                by_replica.setdefault(owned.replica, []).append((request_id, index))
                if index is None:
                    self._release(request_id)
        for replica, mine in by_replica.items():
            if self._up[replica]:
                self.handles[replica].abort.remote(mine)

    async def stop(self, timeout: float) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()

    # ---- following the replicas ---------------------------------------------------------------

    async def _follow(self, replica: int) -> None:
        """Hand on replica's steps; when its stream breaks, fail its requests and wait for it to come back."""
        while not self._stopping:
            try:
                stream = self.handles[replica].options(stream=True).steps.remote()
                async for payload in stream:
                    step = step_decoder.decode(payload)
                    if step.died:
                        break
                    if not self._up[replica]:
                        logger.warning("engine replica %d is back", replica)
                        self.router.forget(replica)
                        self._up[replica] = True
                    self.replica_stats[replica] = step.stats
                    if step.stats.num_blocks != self._cache_blocks[replica]:
                        self._cache_blocks[replica] = step.stats.num_blocks
                        self.router.fit(sum(self._cache_blocks))
                    self._deliver(replica, step.outputs)
            except asyncio.CancelledError:
                if self._stopping or asyncio.current_task().cancelling():
                    raise
                # Serve cancelled the call, not us: it reached a replica that was shutting down (Ray's
                # TaskCancelledError surfaces as CancelledError in async code). Follow the next one.
                logger.warning("engine replica %d cancelled its step stream", replica)
            except Exception as err:  # noqa: BLE001 - a replica that died or restarts
                logger.warning("engine replica %d is down: %s", replica, err)
            self._replica_down(replica)
            await asyncio.sleep(REJOIN_WAIT_S)

    def _deliver(self, replica: int, step: EngineCoreOutputs) -> None:
        mine = [out for out in step.outputs if self._owned.get(out.request_id, _NOBODY).replica == replica]
        for out in mine:
            if out.finished and self._finish_sample(out.request_id):
                self._release(out.request_id)
        self._on_step(EngineCoreOutputs(mine, step.timestamp), self.stats)

    def _finish_sample(self, request_id: str) -> bool:
        """One sample ended; True once all of the request's have."""
        owned = self._owned[request_id]
        owned.samples -= 1
        return owned.samples == 0

    def _release(self, request_id: str) -> None:
        owned = self._owned.pop(request_id, None)
        if owned is not None:
            self._loads[owned.replica] -= 1

    def _replica_down(self, replica: int) -> None:
        if self._stopping:
            return
        self._up[replica] = False
        self.replica_stats[replica] = None
        lost = [request_id for request_id, owned in self._owned.items() if owned.replica == replica]
        self._fail(lost, f"engine replica {replica} died while running this request")

    def _fail(self, request_ids: list[str], error: str) -> None:
        outputs = [EngineCoreOutput(request_id, i, [], finish_reason="error", error=error)
                   for request_id in request_ids for i in range(self._owned[request_id].samples)]
        for request_id in request_ids:
            self._release(request_id)
        if outputs:
            self._on_step(EngineCoreOutputs(outputs, 0.0), self.stats)

    async def _confirm(self, call, request_id: str) -> None:
        """A request the replica could not take (it died meanwhile) fails at once."""
        try:
            await call
        except Exception as err:  # noqa: BLE001
            if request_id in self._owned:
                self._fail([request_id], f"the engine replica did not take the request ({type(err).__name__})")


_NOBODY = _Owned(-1, 0)


def merge_stats(stats: list[EngineStats]) -> EngineStats | None:
    """The replicas' stats as one engine's: counts summed, usage over all their blocks."""
    if not stats:
        return None
    summed: dict[str, Any] = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if f.name == "kv_bytes_per_token":
            summed[f.name] = values[0]
        elif f.name == "kv_bytes_per_seq":
            summed[f.name] = {k: v for d in values for k, v in d.items()}
        elif f.name in ("spec_decode", "kv_offload"):  # counters of their own, where the replicas keep them
            summed[f.name] = _merge_counts(values)
        elif f.name != "kv_cache_usage":
            summed[f.name] = sum(values)
    summed["kv_cache_usage"] = 1.0 - summed["num_free_blocks"] / max(1, summed["num_blocks"])
    return EngineStats(**summed)


def _merge_counts(values: list) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    fields = dataclasses.fields(present[0])
    return type(present[0])(**{f.name: sum(getattr(v, f.name) for v in present) for f in fields})


_EMPTY = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_blocks=0, num_free_blocks=0,
                     peak_blocks_in_use=0, kv_bytes_per_token=0, prefix_cache_queries=0, prefix_cache_hits=0,
                     num_preemptions=0, num_prefill_tokens=0, num_generation_tokens=0)
