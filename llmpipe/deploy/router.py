"""Which replica serves a request.

Prefix-cache affinity (as SGLang's cache-aware router and llm-d's prefix-aware scheduler do): the
router remembers which replica computed each prompt block, keyed like the engine's own prefix cache
(the chain of block hashes), and sends a request to the replica holding its longest known prefix,
if that prefix is at least `min_match` of the prompt's blocks and that replica is no busier than the
least-loaded one plus `slack` requests. Any other request, a new conversation above all, goes to
the replica with the fewest remembered blocks among those within the slack: the router remembers
as many blocks as the replicas' caches hold (`fit`), so that count is each replica's share of
recent prefixes, and new conversations fill the emptier cache instead of evicting from the fuller.
Round-robin is the baseline affinity is measured against.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Protocol, Sequence

from llmpipe.kv_cache.block_pool import block_hash
from llmpipe.errors import LLMPipeError

Loads = Sequence[int | None]  # per replica: requests in flight, None while it is down


class NoReplicaError(LLMPipeError):
    pass


class Router(Protocol):
    def choose(self, token_ids: Sequence[int], loads: Loads) -> int: ...

    def fit(self, capacity: int) -> None: ...

    def forget(self, replica: int) -> None: ...


def _up(loads: Loads) -> list[int]:
    up = [i for i, load in enumerate(loads) if load is not None]
    if not up:
        raise NoReplicaError("no engine replica is up; retry shortly")
    return up


def prefix_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The hashes of the prompt's full blocks, chained as the engine's prefix cache chains them (from the
    request's cache salt)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(block_hash(hashes[-1] if hashes else None, token_ids[start : start + block_size], salt))
    return hashes


class PrefixAffinityRouter:
    def __init__(self, block_size: int, slack: int = 4, min_match: float = 0.5, capacity: int = 1 << 20):
        self.block_size, self.slack, self.min_match, self.capacity = block_size, slack, min_match, capacity
        self.owners: OrderedDict[int, int] = OrderedDict()  # block hash → replica that last computed it (LRU)
        self.remembered: Counter[int] = Counter()  # replica → its blocks in owners

    def choose(self, token_ids: Sequence[int], loads: Loads) -> int:
        up = _up(loads)
        bound = min(loads[i] for i in up) + self.slack
        hashes = prefix_hashes(token_ids, self.block_size)
        holder, matched = self._holder(hashes, loads)
        if holder is not None and loads[holder] <= bound and matched >= self.min_match * len(hashes):
            choice = holder
        else:
            choice = min((i for i in up if loads[i] <= bound), key=lambda i: (self.remembered[i], loads[i]))
        for h in hashes:
            self._own(h, choice)
        self._trim()
        return choice

    def fit(self, capacity: int) -> None:
        """Remember as many blocks as the replicas' KV caches hold together."""
        self.capacity = capacity
        self._trim()

    def forget(self, replica: int) -> None:
        """A replica restarted with an empty cache."""
        for h in [h for h, r in self.owners.items() if r == replica]:
            del self.owners[h]
        self.remembered[replica] = 0

    def _holder(self, hashes: list[int], loads: Loads) -> tuple[int | None, int]:
        """The replica (up) that computed the longest prefix of these blocks, and that prefix's length."""
        for length in range(len(hashes), 0, -1):
            replica = self.owners.get(hashes[length - 1])
            if replica is not None and loads[replica] is not None:
                return replica, length
        return None, 0

    def _own(self, block: int, replica: int) -> None:
        previous = self.owners.get(block)
        if previous is not None:
            self.remembered[previous] -= 1
            self.owners.move_to_end(block)
        self.owners[block] = replica
        self.remembered[replica] += 1

    def _trim(self) -> None:
        while len(self.owners) > self.capacity:
            self.remembered[self.owners.popitem(last=False)[1]] -= 1


class RoundRobinRouter:
    def __init__(self) -> None:
        self.next = 0

    def choose(self, token_ids: Sequence[int], loads: Loads) -> int:
        up = _up(loads)
        choice = next((i for i in up if i >= self.next), up[0])
        self.next = choice + 1
        return choice

    def fit(self, capacity: int) -> None:
        pass

    def forget(self, replica: int) -> None:
        pass


ROUTERS = {"prefix": PrefixAffinityRouter, "round_robin": RoundRobinRouter}


def make_router(name: str, block_size: int) -> Router:
    if name not in ROUTERS:
        raise LLMPipeError(f"routing must be one of {', '.join(ROUTERS)}, got {name!r}")
    return PrefixAffinityRouter(block_size) if name == "prefix" else RoundRobinRouter()
