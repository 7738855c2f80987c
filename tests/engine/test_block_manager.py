"""Block-manager invariants under random allocate / append / fork / free / evict sequences.

A fake pool records which token each slot holds, written only when a position is "computed",
so a prefix-cache hit that served the wrong blocks shows up as a sequence reading foreign tokens.
"""

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from llmpipe.engine.block_manager import BlockManager

BLOCK = 4
NUM_BLOCKS = 24


@dataclass(eq=False)
class FakeSeq:
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_hashed_blocks: int = 0
    computed: int = 0

    @property
    def all_token_ids(self):
        return self.tokens


class World:
    def __init__(self):
        self.bm = BlockManager(NUM_BLOCKS, BLOCK)
        self.pool: dict[tuple[int, int], int] = {}
        self.live: list[FakeSeq] = []

    def compute(self, seq: FakeSeq) -> None:
        for pos in range(seq.computed, len(seq.tokens)):
            self.pool[(seq.block_table[pos // BLOCK], pos % BLOCK)] = seq.tokens[pos]
        seq.computed = len(seq.tokens)
        self.bm.register_full_blocks(seq, seq.computed)

    def check(self) -> None:
        refs = [0] * NUM_BLOCKS
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table)
            for b in seq.block_table:
                refs[b] += 1
            for pos in range(seq.computed):  # every computed position reads this sequence's token
                assert self.pool[(seq.block_table[pos // BLOCK], pos % BLOCK)] == seq.tokens[pos]
        assert refs == [b.ref_count for b in self.bm.blocks]
        assert set(self.bm.free) == {i for i, r in enumerate(refs) if r == 0}
        for h, block_id in self.bm.cached.items():
            assert self.bm.blocks[block_id].hash == h


ops = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.lists(st.integers(0, 2), min_size=1, max_size=14)),
        st.tuples(st.just("append"), st.integers(0, 50), st.integers(0, 2)),
        st.tuples(st.just("fork"), st.integers(0, 50)),
        st.tuples(st.just("free"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_block_manager_invariants_hold_under_random_operations(operations):
    world = World()
    bm = world.bm
    for op in operations:
        if op[0] == "new":
            seq = FakeSeq(list(op[1]))
            if bm.can_allocate(seq):
                bm.allocate(seq)
                seq.computed = seq.num_cached_tokens
                world.live.append(seq)
                world.compute(seq)
        elif op[0] == "append" and world.live:
            seq = world.live[op[1] % len(world.live)]
            seq.tokens.append(op[2])
            if bm.can_append(seq):
                bm.append_slot(seq)
                world.compute(seq)
            else:
                seq.tokens.pop()
        elif op[0] == "fork" and world.live:
            parent = world.live[op[1] % len(world.live)]
            if bm.num_free_blocks:
                child = FakeSeq(list(parent.tokens))
                copy = bm.fork(parent, child)
                if copy is not None:
                    src, dst = copy
                    for offset in range(BLOCK):
                        if (src, offset) in world.pool:
                            world.pool[(dst, offset)] = world.pool[(src, offset)]
                child.computed = parent.computed
                world.live.append(child)
        elif op[0] == "free" and world.live:
            bm.free_sequence(world.live.pop(op[1] % len(world.live)))
        world.check()
    for seq in world.live:
        bm.free_sequence(seq)
    assert bm.num_free_blocks == NUM_BLOCKS and bm.usage == 0.0


def test_prefix_hit_reuses_full_blocks_but_never_the_last_token():
    bm = BlockManager(16, BLOCK)
    first = FakeSeq(list(range(10)))
    bm.allocate(first)
    bm.register_full_blocks(first, 10)
    first_blocks = list(first.block_table)
    bm.free_sequence(first)
    again = FakeSeq(list(range(10)))
    bm.allocate(again)
    assert again.num_cached_tokens == 8 and again.block_table[:2] == first_blocks[:2]
    exact = FakeSeq(list(range(8)))  # ends on a block boundary: its last block must be recomputed
    bm.allocate(exact)
    assert exact.num_cached_tokens == 4


def test_freed_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(4, BLOCK)
    a, b = FakeSeq([1] * 5), FakeSeq([2] * 5)
    for seq in (a, b):
        bm.allocate(seq)
        bm.register_full_blocks(seq, 5)
    a_full, b_full = a.block_table[0], b.block_table[0]
    bm.free_sequence(a)
    bm.free_sequence(b)
    bm.allocate(FakeSeq([3] * 8))  # takes the two oldest free blocks: a's partial one, then a's full one
    assert bm.cached.get(bm.blocks[b_full].hash) == b_full
    hit = FakeSeq([2] * 5)
    bm.allocate(hit)
    assert hit.num_cached_tokens == 4 and hit.block_table[0] == b_full
    assert a_full not in bm.cached.values()
