"""Which replica serves a request.

Prefix-cache affinity (as SGLang's cache-aware router and llm-d's prefix-aware scheduler do): the
router remembers which replica computed each prompt block, keyed like the engine's own prefix cache
(the chain of block hashes), and sends a request to the replica holding its longest known prefix,
unless that replica is busier than the least-loaded one by more than `slack` requests; then, and
for a prefix nobody holds, to the least-loaded. Round-robin is the baseline it is measured against.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, Sequence

from llmpipe.engine.block_pool import block_hash
from llmpipe.errors import LLMPipeError

Loads = Sequence[int | None]  # per replica: requests in flight, None while it is down


class NoReplicaError(LLMPipeError):
    pass


class Router(Protocol):
    def choose(self, token_ids: Sequence[int], loads: Loads) -> int: ...


def _up(loads: Loads) -> list[int]:
    up = [i for i, load in enumerate(loads) if load is not None]
    if not up:
        raise NoReplicaError("no engine replica is up; retry shortly")
    return up


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hashes of the prompt's full blocks, chained as the engine's prefix cache chains them."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(block_hash(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
    return hashes


class PrefixAffinityRouter:
    def __init__(self, block_size: int, slack: int = 4, capacity: int = 1 << 20):
        self.block_size, self.slack, self.capacity = block_size, slack, capacity
        self.owners: OrderedDict[int, int] = OrderedDict()  # block hash → replica that last computed it (LRU)

    def choose(self, token_ids: Sequence[int], loads: Loads) -> int:
        least = min(_up(loads), key=lambda i: loads[i])
        hashes = prefix_hashes(token_ids, self.block_size)
        held = (self.owners[h] for h in reversed(hashes) if h in self.owners)
        preferred = next((r for r in held if loads[r] is not None), None)
        choice = preferred if preferred is not None and loads[preferred] <= loads[least] + self.slack else least
        for h in hashes:
            self.owners[h] = choice
            self.owners.move_to_end(h)
        while len(self.owners) > self.capacity:
            self.owners.popitem(last=False)
        return choice

    def forget(self, replica: int) -> None:
        """A replica restarted with an empty cache."""
        for h in [h for h, r in self.owners.items() if r == replica]:
            del self.owners[h]


class RoundRobinRouter:
    def __init__(self) -> None:
        self.next = 0

    def choose(self, token_ids: Sequence[int], loads: Loads) -> int:
        up = _up(loads)
        choice = next((i for i in up if i >= self.next), up[0])
        self.next = choice + 1
        return choice

    def forget(self, replica: int) -> None:
        pass


ROUTERS = {"prefix": PrefixAffinityRouter, "round_robin": RoundRobinRouter}


def make_router(name: str, block_size: int) -> PrefixAffinityRouter | RoundRobinRouter:
    if name not in ROUTERS:
        raise LLMPipeError(f"routing must be one of {', '.join(ROUTERS)}, got {name!r}")
    return PrefixAffinityRouter(block_size) if name == "prefix" else RoundRobinRouter()
