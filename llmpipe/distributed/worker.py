"""Ranks 1..N-1: load this rank's shard, then run rank 0's commands until it says stop.

Commands (sent by executor.py): init_cache (allocate this rank's paged KV cache), forward (one
step's inputs: token ids, positions, per-layer attention metadata, logit rows), copy_block (a
forked sequence's partial block), memory (report resident bytes), stop.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from llmpipe.config import EngineConfig
from llmpipe.distributed.channel import CommandChannel
from llmpipe.distributed.model_shard import forward, load_shard, rank_memory
from llmpipe.distributed.parallel_state import (
    ParallelState, announce, join, leave, rank_config, read_config, torchrun_store, wait_for_go,
)
from llmpipe.kv_cache.layout import KVCacheLayout
from llmpipe.engine.model_runner import ModelRunner
from llmpipe.loader import load_checkpoint

logger = logging.getLogger(__name__)

STARTUP = timedelta(minutes=5)  # how long a worker waits for rank 0's store, and for the other ranks to start


def local_main(argv: list[str]) -> int:
    """A worker rank 0 started on this machine (processes.py): rank, world size, store port."""
    rank, world, port = int(argv[0]), int(argv[1]), int(argv[2])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=STARTUP)
    return serve(store, rank, world)


def torchrun_main() -> int:
    """Ranks > 0 under torchrun (see llmpipe.cli)."""
    store, rank, world = torchrun_store(STARTUP)
    return serve(store, rank, world)


def serve(store: dist.Store, rank: int, world: int) -> int:
    """Join, load, serve; the exit status (0 after rank 0's stop)."""
    config = read_config(store)
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    torch.set_num_threads(config.num_threads)
    announce(store, "up", rank)
    wait_for_go(store)  # every rank is up: joining cannot time out on a slow starter
    state = join(store, rank, world, config)
    try:
        config = rank_config(config, state)
        try:
            model = load_shard(load_checkpoint(config.model), config, rank, world)
        except Exception as exc:  # rank 0 raises it
            announce(store, "loaded", rank, f"{type(exc).__name__}: {exc}")
            return 1
        announce(store, "loaded", rank)
        Worker(model, config, state).loop()
        return 0
    except Exception:
        logger.exception("tensor-parallel worker failed")
        return 1
    finally:
        leave()


class Worker:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, state: ParallelState):
        self.model, self.config, self.state = model, config, state
        self.channel = CommandChannel(state.commands, state.timeout, state.device)
        self.runner: ModelRunner | None = None
        self.num_blocks = 0

    def loop(self) -> None:
        handlers = {"init_cache": self.init_cache, "forward": self.forward, "copy_block": self.copy_block,
                    "memory": self.memory}
        while True:
            name, *args = self.channel.receive()
            if name == "stop":
                return
            handlers[name](*args)

    def init_cache(self, num_blocks: int, layout: KVCacheLayout) -> None:
        local = replace(self.config, model_config=self.model.config)  # this rank's heads
        self.runner = ModelRunner(self.model, local, num_blocks, layout)
        self.num_blocks = num_blocks

    def forward(self, ids, positions, metas, logit_rows, pool_spans=()) -> None:
        forward(self.model, self.runner.kv_cache, ids, positions, metas, logit_rows, pool_spans)

    def copy_block(self, src: int, dst: int) -> None:
        self.runner.kv_cache.copy_block(src, dst)

    def memory(self) -> None:
        dist.gather_object(rank_memory(self.state.rank, self.model, self.runner.kv_cache, self.num_blocks), dst=0)


if __name__ == "__main__":
    status = local_main(sys.argv[1:])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # skip the interpreter's teardown (a second or more with torch loaded): rank 0 waits for it
