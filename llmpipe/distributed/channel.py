"""Rank 0's commands to the other ranks: one pickled tuple per step, broadcast over a gloo group.

A command goes in a fixed-size buffer (its length, then its bytes), so one broadcast carries a
step's metadata; a longer one sends its remainder in a second broadcast. Tensors travel as numpy
arrays and land on the receiver's device. Rank 0 sends with the collective timeout (a hung worker
surfaces as an error); a worker waits for the next command without one (rank 0 may be idle for
hours), yet notices at once when rank 0's process dies: gloo's connection closes.
"""

from __future__ import annotations

import dataclasses
import pickle
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

CAPACITY = 1 << 15  # bytes per broadcast; a decode step's metadata fits in one
HEADER = 8  # the command's length in bytes, little-endian


class CommandChannel:
    def __init__(self, group: dist.ProcessGroup, timeout: timedelta, device: torch.device):
        self.group, self.timeout, self.device = group, timeout, device
        self.buffer = torch.zeros(CAPACITY, dtype=torch.uint8)

    def send(self, *command: Any) -> None:
        """Rank 0: broadcast one command to every other rank."""
        data = len_prefixed(pickle.dumps(_map(command, _to_numpy), protocol=pickle.HIGHEST_PROTOCOL))
        first = data[:CAPACITY]
        self.buffer[: len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        self._broadcast(self.buffer, self.timeout)
        if len(data) > CAPACITY:
            self._broadcast(torch.frombuffer(bytearray(data[CAPACITY:]), dtype=torch.uint8), self.timeout)

    def receive(self) -> tuple:
        """Other ranks: the next command, waiting as long as it takes."""
        self._broadcast(self.buffer, None)
        size = HEADER + int.from_bytes(self.buffer[:HEADER].numpy().tobytes(), "little")
        data = self.buffer[: min(size, CAPACITY)].numpy().tobytes()
        if size > CAPACITY:
            rest = torch.empty(size - CAPACITY, dtype=torch.uint8)
            self._broadcast(rest, self.timeout)
            data += rest.numpy().tobytes()
        command = pickle.loads(data[HEADER:])  # from rank 0 of this job
        return _map(command, lambda leaf: _to_tensor(leaf, self.device))

    def _broadcast(self, tensor: torch.Tensor, timeout: timedelta | None) -> None:
        self.group.broadcast(tensor, 0, timeout).wait()


def len_prefixed(data: bytes) -> bytes:
    return len(data).to_bytes(HEADER, "little") + data


def _to_numpy(leaf: Any) -> Any:
    return leaf.cpu().numpy() if isinstance(leaf, torch.Tensor) else leaf


def _to_tensor(leaf: Any, device: torch.device) -> Any:
    return torch.from_numpy(leaf).to(device) if isinstance(leaf, np.ndarray) else leaf


def _map(obj: Any, leaf: Callable[[Any], Any], memo: dict | None = None) -> Any:
    """obj with `leaf` applied to every leaf of its tuples, lists and dataclasses; an object that
    appears several times (layers sharing one AttentionMetadata) is mapped once and stays shared."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, (list, tuple)):
        out = type(obj)(_map(item, leaf, memo) for item in obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        out = dataclasses.replace(obj, **{name: _map(getattr(obj, name), leaf, memo) for name in fields})
    else:
        out = leaf(obj)
    memo[id(obj)] = out
    return out
