"""The process groups of a tensor-parallel engine, launched two ways.

- Local: the engine's process is rank 0; it hosts a TCPStore on a free loopback port and starts
  ranks 1..N-1 as processes on this machine (llmpipe.distributed.processes).
- torchrun: every rank is launched by `torchrun`, which sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
  RANK (and LOCAL_RANK); rank 0 runs the command, the others serve it (`llmpipe.cli` hands them
  to llmpipe.distributed.worker).

Either way the start-up goes through the store: rank 0 publishes its EngineConfig; each worker
announces when it is up (imported); rank 0, watching its workers live, waits for all of them and
says go; every rank joins the groups and loads its shard; each worker announces it loaded (or its
error). Start-up takes seconds and loading minutes, so neither is held to the collective timeout.
Two groups: the default one (gloo on CPU, NCCL on CUDA) carries the forward pass's collectives,
which fail after `distributed_timeout_s`; a gloo group carries rank 0's commands, on which a worker
waits as long as rank 0 stays idle (rank 0's own sends keep the short timeout: channel.py).
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from llmpipe.config import EngineConfig
from llmpipe.errors import LLMPipeError

TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
CONFIG_KEY = "llmpipe/engine_config"
IDLE = timedelta(days=3650)  # a worker waits this long for rank 0's next command
POLL_S = 0.05


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARS)


def torchrun_worker() -> bool:
    """This process is a rank other than 0 of a torchrun launch."""
    return launched_by_torchrun() and os.environ["RANK"] != "0"


@dataclass
class ParallelState:
    rank: int
    world_size: int
    device: torch.device
    commands: dist.ProcessGroup  # gloo, waits without a practical limit on the receiving side
    timeout: timedelta


def timeout_of(config: EngineConfig) -> timedelta:
    return timedelta(seconds=config.distributed_timeout_s)


def torchrun_store(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """(store, rank, world size) from torchrun's environment."""
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    return store, rank, world


def publish_config(store: dist.Store, config: EngineConfig) -> None:
    store.set(CONFIG_KEY, pickle.dumps(config))


def read_config(store: dist.Store) -> EngineConfig:
    return pickle.loads(store.get(CONFIG_KEY))  # written by rank 0 of this job (publish_config)


def announce(store: dist.Store, stage: str, rank: int, message: str = "") -> None:
    """A worker tells rank 0 it reached `stage` ("up", "loaded"), with an error message or ""."""
    store.set(f"llmpipe/{stage}/{rank}", message.encode())


def await_ranks(store: dist.Store, stage: str, ranks: range, check: Callable[[], None], limit: timedelta) -> list[str]:
    """Rank 0: the messages of `ranks` once all reached `stage`; check() runs meanwhile (it raises
    when a worker died)."""
    keys = [f"llmpipe/{stage}/{rank}" for rank in ranks]
    deadline = time.monotonic() + limit.total_seconds()
    while not store.check(keys):
        check()
        if time.monotonic() > deadline:
            raise LLMPipeError(f"tensor-parallel ranks {list(ranks)} did not report '{stage}' within {limit}")
        time.sleep(POLL_S)
    return [store.get(key).decode() for key in keys]


def give_go(store: dist.Store) -> None:
    """Rank 0, once every worker is up: join the process groups now."""
    store.set("llmpipe/go", b"")


def wait_for_go(store: dist.Store) -> None:
    store.get("llmpipe/go")  # blocks up to the store's timeout


def join(store: dist.Store, rank: int, world: int, config: EngineConfig) -> ParallelState:
    """Join the job's process groups; every rank calls this with rank 0's config."""
    device = rank_device(config, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timeout_of(config)
    dist.init_process_group(backend, store=dist.PrefixStore("llmpipe/group", store), rank=rank, world_size=world, timeout=timeout)
    commands = dist.new_group(backend="gloo", timeout=IDLE)
    return ParallelState(rank, world, device, commands, timeout)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """CPU, or the CUDA device of this rank on its machine (LOCAL_RANK under torchrun)."""
    kind = torch.device(config.device).type
    if kind != "cuda":
        return torch.device(kind)
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))


def rank_config(config: EngineConfig, state: ParallelState) -> EngineConfig:
    """The config a rank runs its shard with: its own device."""
    return replace(config, device=str(state.device))


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
