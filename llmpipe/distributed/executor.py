"""Rank 0 of a tensor-parallel engine, inside the LLMEngine's process.

It starts the other ranks (spawned here, or already launched by torchrun), holds rank 0's shard,
and stands in for the ModelRunner: each step it prepares the batch with an ordinary ModelRunner
(ids, positions, per-layer attention metadata, logit rows), broadcasts that to the workers, runs
its own shard and returns the logits the vocabulary-parallel head gathered. The scheduler and the
sampler stay in the engine, once.

Any failure of a rank (its process died, a collective timed out) ends the whole group: the
workers are stopped, and this and every later call raise LLMPipeError saying which rank failed.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from llmpipe.config import EngineConfig
from llmpipe.distributed.channel import CommandChannel
from llmpipe.distributed.model_shard import RankMemory, forward, load_shard, rank_memory
from llmpipe.distributed.parallel_state import (
    await_ranks, give_go, join, launched_by_torchrun, leave, publish_config, rank_config, timeout_of, torchrun_store,
)
from llmpipe.distributed.processes import LocalWorkers
from llmpipe.distributed.sharding import plan_shards
from llmpipe.kv_cache.kinds import BlockTable
from llmpipe.kv_cache.layout import KVCacheLayout
from llmpipe.engine.model_runner import ModelRunner, RunnerOutput
from llmpipe.engine.scheduler import SchedulerOutput
from llmpipe.errors import LLMPipeError
from llmpipe.loader import Checkpoint

logger = logging.getLogger(__name__)

# While a spawned worker lives, rank 0 waits for it to start and load up to these limits (under
# torchrun it cannot see the other ranks' processes: the limits are all there is).
STARTUP = timedelta(minutes=5)
LOADING = timedelta(hours=1)


class _Group:
    """What shutting down needs, kept apart from the executor so a finalizer can hold it."""

    def __init__(self, workers: LocalWorkers | None, threads: int):
        self.workers, self.threads = workers, threads
        self.channel: CommandChannel | None = None
        self.failed = False
        self.busy = False  # a step was interrupted (Ctrl-C): the workers are inside a collective

    def shutdown(self) -> None:
        self.failed = self.failed or self.busy
        if self.channel is not None and not self.failed:
            try:
                self.channel.send("stop")
            except Exception:  # noqa: BLE001 - a worker already gone is what we are cleaning up after
                self.failed = True
        leave()
        if self.workers is not None:
            self.workers.stop(grace_s=0.5 if self.failed else 5.0)
        torch.set_num_threads(self.threads)


class TensorParallelExecutor:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig, progress: bool = True):
        world = config.tensor_parallel_size
        if dist.is_initialized():  # the default process group is per process
            raise LLMPipeError("torch.distributed is already initialised in this process: one tensor-parallel engine at a time")
        plan_shards(config.model_config, world, checkpoint.quant_plan(config.weight_quantization, config.group_size))
        threads = torch.get_num_threads()
        per_rank = config.num_threads or max(1, threads // world)  # the machine's threads, shared out
        self.config = replace(config, num_threads=per_rank)
        self._failure: str | None = None
        self.local: ModelRunner | None = None
        self.num_blocks = 0
        self._store, workers = self._launch(world)
        self._group = _Group(workers, threads)
        self._finalizer = weakref.finalize(self, self._group.shutdown)
        torch.set_num_threads(per_rank)  # rank 0 is one of the ranks (restored on shutdown)
        with self._guard():
            self._await("up", STARTUP)
            give_go(self._store)
            self.state = join(self._store, 0, world, self.config)
            self.config = rank_config(self.config, self.state)
            self.channel = self._group.channel = CommandChannel(self.state.commands, self.state.timeout, self.state.device)
            self.model = load_shard(checkpoint, self.config, 0, world, progress)
            failed = [f"rank {r}: {e}" for r, e in enumerate(self._await("loaded", LOADING), start=1) if e]
            if failed:
                raise LLMPipeError(f"tensor-parallel load failed on {'; '.join(failed)}")

    def _launch(self, world: int) -> tuple[dist.Store, LocalWorkers | None]:
        timeout = timeout_of(self.config)
        if launched_by_torchrun():
            store, rank, size = torchrun_store(timeout)
            if rank != 0 or size != world:
                raise LLMPipeError(
                    f"torchrun started rank {rank} of {size}; the engine runs on rank 0 of tensor_parallel_size={world}"
                )
            publish_config(store, self.config)
            return store, None
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        publish_config(store, self.config)
        return store, LocalWorkers(world, store.port)

    def _await(self, stage: str, limit: timedelta) -> list[str]:
        """The workers' messages once all reached `stage`, failing at once if one of them died."""
        return await_ranks(self._store, stage, range(1, self.config.tensor_parallel_size), self._check_workers, limit)

    def _check_workers(self) -> None:
        dead = self._group.workers.dead() if self._group.workers else []
        if dead:
            raise LLMPipeError(f"worker {', '.join(dead)}")

    def start(self, num_blocks: int, layout: KVCacheLayout) -> TensorParallelExecutor:
        """Allocate every rank's KV cache (num_blocks blocks of its own KV heads)."""
        with self._guard():
            self.channel.send("init_cache", num_blocks, layout)
            self.local = ModelRunner(self.model, replace(self.config, model_config=self.model.config), num_blocks, layout)
            self.num_blocks = num_blocks
        return self

    # ---- what the engine calls on its runner ------------------------------------------------

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """As ModelRunner.execute: rank 0's logits and pooling summaries."""
        self.copy_blocks(batch.block_copies)
        inputs = self.local.prepare_inputs(batch)
        return self._forward(inputs.ids, inputs.positions, inputs.metas, inputs.logit_rows, inputs.pool_spans)

    def score(self, token_ids: list[int], block_tables: list[BlockTable], last_only: bool = False) -> torch.Tensor:
        metas = self.local.prefill_metadata(block_tables, len(token_ids))
        n, device = len(token_ids), self.local.device
        rows = torch.arange(n - 1 if last_only else 0, n, device=device)
        return self._forward(torch.tensor(token_ids, device=device), torch.arange(n, device=device), metas, rows).logits

    @property
    def kv_cache(self) -> ShardedKVCache:
        return ShardedKVCache(self)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:  # on every rank, before the forward writes
            self.copy_block(src, dst)

    def copy_block(self, src: int, dst: int) -> None:
        with self._guard():
            self.channel.send("copy_block", src, dst)
            self.local.kv_cache.copy_block(src, dst)

    def rank_memory(self) -> list[RankMemory]:
        """Every rank's resident weight and KV cache bytes."""
        with self._guard():
            self.channel.send("memory")
            mine = rank_memory(0, self.model, self.local.kv_cache, self.num_blocks)
            gathered: list[RankMemory] = [None] * self.state.world_size
            dist.gather_object(mine, gathered, dst=0)
        return gathered

    @property
    def worker_pids(self) -> list[int]:
        """The processes this executor started (none under torchrun)."""
        workers = self._group.workers
        return [p.pid for p in workers.processes] if workers is not None else []

    def close(self) -> None:
        """Stop the workers and leave the process group (also done when the executor is collected)."""
        self._finalizer()

    def _forward(self, *inputs) -> RunnerOutput:
        with self._guard():
            self.channel.send("forward", *inputs)
            return forward(self.model, self.local.kv_cache, *inputs)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn any failure into one LLMPipeError naming its cause, after stopping every rank."""
        if self._failure is not None:
            raise LLMPipeError(self._failure)
        if not self._finalizer.alive:
            raise LLMPipeError("the tensor-parallel engine is closed")
        try:
            self._check_workers()
            self._group.busy = True
            yield
            self._group.busy = False
        except Exception as exc:
            self._failure = f"tensor-parallel engine stopped: {self._cause(exc)}"
            self._group.failed = True
            self._finalizer()
            raise LLMPipeError(self._failure) from exc

    def _cause(self, exc: Exception) -> str:
        if isinstance(exc, LLMPipeError):  # ours: it says what happened
            return str(exc)
        if self._group.workers is not None:
            self._group.workers.reap(0.2)  # a worker killed a moment ago: let it be reaped to say so
            try:
                self._check_workers()
            except LLMPipeError as dead:
                return str(dead)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"a collective failed or timed out (distributed_timeout_s={self.config.distributed_timeout_s}): {first_line}"


class ShardedKVCache:
    """The engine's view of the ranks' KV caches: sizes are rank 0's."""

    def __init__(self, executor: TensorParallelExecutor):
        self.bytes_per_token = executor.local.kv_cache.bytes_per_token  # per rank; rank 0 holds the most heads
