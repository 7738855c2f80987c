"""An engine replica (the class Ray Serve deploys), driven directly: `close` ends the step streams a
front end follows, so Serve's graceful shutdown has no call left to wait out."""

from __future__ import annotations

import asyncio

from llmpipe.deploy.replica import EngineReplica, step_decoder

HANG_GUARD_S = 60.0


def test_close_ends_every_step_stream(tiny_path):
    replica = EngineReplica({"model": tiny_path, "num_threads": 1})

    async def follow_then_close() -> list[int]:
        streams = [replica.steps() for _ in range(2)]
        snapshots = [step_decoder.decode(await anext(stream)) for stream in streams]
        await replica.close()

        async def drain(stream) -> None:
            async for _ in stream:
                pass

        await asyncio.wait_for(asyncio.gather(*(drain(stream) for stream in streams)), HANG_GUARD_S)
        return [snapshot.stats.num_blocks for snapshot in snapshots]

    try:
        blocks = asyncio.run(follow_then_close())
    finally:
        replica.client.close()
    assert blocks[0] == blocks[1] > 0 and not replica._subscribers
