"""The ingress's client over replicas, on fake Serve handles (no Ray): how it follows a replica's step
stream when Serve breaks or cancels it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from llmpipe.deploy import client as client_module
from llmpipe.deploy.client import DataParallelCoreClient
from llmpipe.deploy.replica import ReplicaStep, encoder
from llmpipe.deploy.router import RoundRobinRouter
from llmpipe.engine.core_messages import EngineStats
from llmpipe.engine.core_messages import EngineCoreOutputs

STATS = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_blocks=8, num_free_blocks=8,
                    peak_blocks_in_use=0, kv_bytes_per_token=64, prefix_cache_queries=0, prefix_cache_hits=0,
                    num_preemptions=0, num_prefill_tokens=0, num_generation_tokens=0)
SNAPSHOT = encoder.encode(ReplicaStep(EngineCoreOutputs([], 0.0), STATS))
CANCELLED = object()  # Serve cancelled the call: Ray's TaskCancelledError reaches async code as CancelledError
BROKEN = object()  # the replica's actor died under the stream


async def replica_stream(script: list):
    for item in script:
        if item is CANCELLED:
            raise asyncio.CancelledError
        if item is BROKEN:
            raise RuntimeError("actor died")
        yield item
    await asyncio.Event().wait()  # then idle, as a replica with nothing to run


class FakeHandle:
    """A DeploymentHandle whose `steps` calls play the given scripts in turn."""

    def __init__(self, *scripts: list) -> None:
        self.scripts, self.calls = list(scripts), 0
        self.steps = self

    def options(self, stream: bool) -> "FakeHandle":
        return self

    def remote(self):
        self.calls += 1
        return replica_stream(self.scripts.pop(0) if self.scripts else [SNAPSHOT])


async def follow(handles: list[FakeHandle], until) -> DataParallelCoreClient:
    client = DataParallelCoreClient(handles, [None] * len(handles), [None] * len(handles), RoundRobinRouter())
    client.start(lambda step, stats: None, lambda reason: None)
    for _ in range(1000):
        if until(client):
            return client
        await asyncio.sleep(0.001)
    raise AssertionError("the client never reached the expected state")


@pytest.fixture(autouse=True)
def no_rejoin_wait(monkeypatch):
    monkeypatch.setattr(client_module, "REJOIN_WAIT_S", 0.0)


@pytest.mark.parametrize("breaks", [CANCELLED, BROKEN], ids=["cancelled by serve", "actor died"])
def test_a_replica_whose_step_stream_breaks_is_followed_again_when_it_answers(breaks):
    async def scenario():
        handles = [FakeHandle([SNAPSHOT, breaks], [SNAPSHOT]), FakeHandle([SNAPSHOT])]
        client = await follow(handles, lambda c: handles[0].calls == 2 and c._up[0] and c.replica_stats[0])
        assert all(not task.done() for task in client._tasks)
        assert dataclasses.asdict(client.stats)["num_blocks"] == 16  # both replicas' stats again
        await client.stop(1.0)
        await asyncio.sleep(0)
        assert all(task.cancelled() for task in client._tasks)  # our own cancellation still ends them

    asyncio.run(scenario())
