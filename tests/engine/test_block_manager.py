"""Block-manager invariants under random allocate / append / fork / free / evict sequences.

A fake pool records which token each slot holds, written only when a position is "computed",
so a prefix-cache hit that served the wrong blocks shows up as a sequence reading foreign tokens.
The manager runs two KV cache groups, one full-attention and one sliding-window, as Gemma 3 does,
or a sliding-window group and compressed groups (one row per `ratio` tokens), as DeepSeek V4 does.
"""

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from llmpipe.engine.block_manager import BlockManager, BlockTable, PrefixHit
from llmpipe.kv_cache.kinds import CompressedSpec, FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from llmpipe.kv_cache.offload_tier import LoadBlock, SaveBlock, TierEntry, TierStats

BLOCK = 4
NUM_BLOCKS = 48
WINDOW = 6
SPECS = [FullAttentionSpec(), SlidingWindowSpec(WINDOW)]
V4_SPECS = [SlidingWindowSpec(WINDOW), CompressedSpec(ratio=2), FullAttentionSpec()]


def ratio(spec: KVCacheSpec) -> int:
    """Tokens per cache row."""
    return getattr(spec, "ratio", 1)


@dataclass(eq=False)
class FakeSeq:
    tokens: list[int]
    block_tables: list = field(default_factory=list)
    block_hashes: list = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_hashed_blocks: int = 0
    cache_salt: str | None = None

    @property
    def all_token_ids(self):
        return self.tokens


def no_hit(specs=SPECS) -> PrefixHit:
    return PrefixHit(0, [BlockTable() for _ in specs])


class FakeTier:
    """An offload tier keeping each saved block's rows (as the fake pool records them), `capacity` blocks at most."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: dict = {}
        self.stats = TierStats()

    def __contains__(self, key) -> bool:
        return key in self.entries

    def put(self, key, tokens, rows) -> None:
        self.entries[key] = TierEntry(key, tokens, rows)
        while len(self.entries) > self.capacity:
            del self.entries[next(iter(self.entries))]

    def end_lookup(self) -> None:
        pass

    def find(self, key, tokens):
        entry = self.entries.get(key)
        return entry if entry is not None and entry.tokens == tokens else None


class World:
    def __init__(self, specs=SPECS, num_blocks=NUM_BLOCKS, copying=False, tier: FakeTier | None = None):
        # copying: prefix hits may end inside a compressed block, copied as the engine's runner would
        self.tier = tier
        self.bm = BlockManager(num_blocks, BLOCK, specs, copy_partial_blocks=copying, tier=tier)
        self.pool: dict[tuple[int, int], int] = {}
        self.live: list[FakeSeq] = []

    def copy(self, src: int, dst: int) -> None:
        for offset in range(BLOCK):
            if (src, offset) in self.pool:
                self.pool[(dst, offset)] = self.pool[(src, offset)]

    def make_copies(self) -> None:
        """The block copies and tier transfers the manager queued, as the runner makes them before a step's forward."""
        for op in self.bm.take_block_copies():
            if isinstance(op, SaveBlock):
                self.tier.put(op.key, op.tokens, {o: self.pool[(op.block_id, o)] for o in range(BLOCK)
                                                  if (op.block_id, o) in self.pool})
            elif isinstance(op, LoadBlock):
                for o in range(BLOCK):
                    self.pool.pop((op.block_id, o), None)
                self.pool.update({(op.block_id, o): row for o, row in op.entry.tensors.items()})
            else:
                self.copy(*op)

    def admit(self, seq: FakeSeq) -> bool:
        hit = self.bm.prefix_hit(seq)
        if not self.bm.can_allocate(seq, hit, len(seq.tokens) - hit.num_tokens):
            return False
        self.bm.allocate(seq, hit, len(seq.tokens) - hit.num_tokens)
        seq.num_computed_tokens = hit.num_tokens  # as the scheduler counts a hit
        self.make_copies()
        self.live.append(seq)
        self.compute(seq)
        return True

    def step(self, seq: FakeSeq) -> bool:
        """Compute the newest token, as a decode step does."""
        self.bm.free_unreachable(seq)
        if not self.bm.can_reserve(seq, 1):
            return False
        self.bm.reserve(seq, 1)
        self.compute(seq)
        return True

    def compute(self, seq: FakeSeq) -> None:
        """Write each new token's row; a compressed group writes entry e (its tokens) once its last token is in."""
        for pos in range(seq.num_computed_tokens, len(seq.tokens)):
            for spec, table in zip(self.bm.specs, seq.block_tables):
                if (pos + 1) % ratio(spec) == 0:
                    row = pos // ratio(spec)
                    self.pool[(table.block_of(row, BLOCK), row % BLOCK)] = self.row(seq, spec, row)
        seq.num_computed_tokens = len(seq.tokens)
        self.bm.register_full_blocks(seq, seq.num_computed_tokens)
        self.make_copies()  # the blocks it listed are saved before anything else writes them

    @staticmethod
    def row(seq: FakeSeq, spec: KVCacheSpec, row: int) -> tuple[int, ...]:
        return tuple(seq.tokens[row * ratio(spec) : (row + 1) * ratio(spec)])

    def check(self) -> None:
        refs = [0] * self.bm.num_blocks
        for seq in self.live:
            for spec, table in zip(self.bm.specs, seq.block_tables):
                assert len(set(table.ids)) == len(table.ids)
                for b in table.ids:
                    refs[b] += 1
                # Every row the next query can read holds this sequence's tokens.
                first = spec.first_needed_block(seq.num_computed_tokens, BLOCK) * BLOCK
                for row in range(first, seq.num_computed_tokens // ratio(spec)):
                    assert self.pool[(table.block_of(row, BLOCK), row % BLOCK)] == self.row(seq, spec, row)
        pool = self.bm.pool
        assert refs == [b.ref_count for b in pool.blocks]
        assert set(pool.free) == {i for i, r in enumerate(refs) if r == 0}
        for key, block_id in pool.cached.items():
            assert key in pool.blocks[block_id].listed and 0 <= key[0] < len(self.bm.specs)


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
@given(ops, st.sampled_from([(SPECS, False), (V4_SPECS, False), (V4_SPECS, True)]))
def test_block_manager_invariants_hold_under_random_operations(operations, setup):
    run_operations(World(*setup[:1], copying=setup[1]), operations)


# Prompts sharing prefixes (three conversations, cut anywhere, with a tail of their own): what a tier serves.
PROMPTS = [[(7 * c + i) % 5 for i in range(24)] for c in range(3)]
shared_prefix_ops = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.builds(lambda c, n, tail: PROMPTS[c][:n] + tail, st.integers(0, 2),
                                            st.integers(1, 24), st.lists(st.integers(0, 2), max_size=3))),
        st.tuples(st.just("append"), st.integers(0, 50), st.integers(0, 2)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("free"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(shared_prefix_ops, st.sampled_from([(SPECS, False), (V4_SPECS, True), ([FullAttentionSpec()], False)]),
       st.integers(4, 60), st.integers(8, 16))
def test_with_an_offload_tier_evicted_prefixes_come_back_holding_their_own_tokens(operations, setup, capacity,
                                                                                   num_blocks):
    """A small pool under a tier: prefixes the pool evicted are restored from the tier, and every row a
    sequence reads is still its own (World.check)."""
    run_operations(World(setup[0], num_blocks=num_blocks, copying=setup[1], tier=FakeTier(capacity)), operations)


def test_a_prefix_evicted_from_the_pool_is_restored_from_the_tier():
    world = World(specs=[FullAttentionSpec()], num_blocks=5, tier=FakeTier(100))
    donor = FakeSeq(list(range(13)))
    assert world.admit(donor)
    world.bm.free_sequence(donor)
    world.live.clear()
    other = FakeSeq([99] * 20)  # takes every block: the donor's are evicted from the pool
    assert world.admit(other)
    world.bm.free_sequence(other)
    world.live.clear()
    assert not any(key[1] in donor.block_hashes for key in world.bm.pool.cached)
    again = FakeSeq(list(range(13)))
    assert world.admit(again)
    assert again.num_cached_tokens == 12 and world.tier.stats.restored == 3  # three blocks from the tier
    world.check()


def run_operations(world: World, operations: list[tuple]) -> None:
    """Admit, grow, fork and free sequences as `operations` say, checking the invariants after each."""
    bm = world.bm
    for op in operations:
        if op[0] == "new":
            world.admit(FakeSeq(list(op[1])))
        elif op[0] == "append" and world.live:
            seq = world.live[op[1] % len(world.live)]
            seq.tokens.append(op[2])
            if not world.step(seq):
                seq.tokens.pop()
        elif op[0] == "fork" and world.live:
            parent = world.live[op[1] % len(world.live)]
            if bm.can_fork(parent):
                child = FakeSeq(list(parent.tokens))
                bm.fork(parent, child)
                world.make_copies()
                child.num_computed_tokens = parent.num_computed_tokens
                world.live.append(child)
        elif op[0] == "free" and world.live:
            bm.free_sequence(world.live.pop(op[1] % len(world.live)))
        world.check()
    for seq in world.live:
        bm.free_sequence(seq)
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0


def test_window_group_frees_blocks_as_the_sequence_grows_and_full_group_keeps_all():
    world = World(num_blocks=NUM_BLOCKS)
    seq = FakeSeq([7] * 5)
    assert world.admit(seq)
    for _ in range(60):
        seq.tokens.append(len(seq.tokens) % 3)
        assert world.step(seq)
        full, window = seq.block_tables
        assert len(full.ids) == -(-len(seq.tokens) // BLOCK)
        # The window group holds the blocks of the last WINDOW tokens and the one being filled, no more.
        assert len(window.ids) <= -(-WINDOW // BLOCK) + 1
        assert window.offset == max(0, len(seq.tokens) - WINDOW) // BLOCK  # first block the newest query read
    world.bm.free_sequence(seq)
    assert world.bm.num_free_blocks == NUM_BLOCKS  # freed window blocks went back to the pool


def test_prefix_hit_reuses_full_blocks_but_never_the_last_token():
    world = World(specs=[FullAttentionSpec()])
    first = FakeSeq(list(range(10)))
    world.admit(first)
    first_blocks = list(first.block_tables[0].ids)
    world.bm.free_sequence(first)
    again = FakeSeq(list(range(10)))
    world.admit(again)
    assert again.num_cached_tokens == 8 and again.block_tables[0].ids[:2] == first_blocks[:2]
    exact = FakeSeq(list(range(8)))  # ends on a block boundary: its last block must be recomputed
    world.admit(exact)
    assert exact.num_cached_tokens == 4


def test_window_prefix_is_reusable_only_while_its_window_blocks_are_held():
    world = World(num_blocks=NUM_BLOCKS)
    tokens = list(range(40))
    donor = FakeSeq(list(tokens))
    world.admit(donor)
    world.bm.free_sequence(donor)
    hit = world.bm.prefix_hit(FakeSeq(list(tokens)))
    assert hit.num_tokens == 36  # every block but the one holding the last token
    full, window = hit.tables
    assert full.offset == 0 and len(full.ids) == 9
    # The window group brings only the blocks the next query (position 36) reads: 31..35.
    assert window.offset == (36 - WINDOW + 1) // BLOCK and len(window) == 9
    # Evict the window group's copy of block 8 (tokens 32..35): no prefix past block 7 is servable,
    # and a 7-block prefix needs the window group's blocks 6 and 7 (tokens 27..31 for position 28).
    block8 = world.bm.pool.cached[(1, donor.block_hashes[8])]
    world.bm.pool.free.move_to_end(block8, last=False)
    world.bm.pool.take()
    assert world.bm.prefix_hit(FakeSeq(list(tokens))).num_tokens == 32


def test_freed_blocks_are_evicted_least_recently_freed_first():
    world = World(specs=[FullAttentionSpec()], num_blocks=4)
    bm = world.bm
    a, b = FakeSeq([1] * 5), FakeSeq([2] * 5)
    for seq in (a, b):
        world.admit(seq)
    a_full, b_full = a.block_tables[0].ids[0], b.block_tables[0].ids[0]
    (a_key,) = bm.pool.blocks[a_full].listed
    bm.free_sequence(a)
    bm.free_sequence(b)
    world.live.clear()
    world.admit(FakeSeq([3] * 8))  # takes the two oldest free blocks: a's partial one, then a's full one
    (b_key,) = bm.pool.blocks[b_full].listed
    assert bm.pool.cached.get(b_key) == b_full
    hit = FakeSeq([2] * 5)
    world.admit(hit)
    assert hit.num_cached_tokens == 4 and hit.block_tables[0].ids[0] == b_full
    assert a_key not in bm.pool.cached  # a's full block was evicted


def test_compressed_group_blocks_span_ratio_blocks_and_prefix_hits_cover_whole_ones():
    specs = [SlidingWindowSpec(WINDOW), CompressedSpec(ratio=4)]  # a compressed block: 4 rows of 4 tokens each
    world = World(specs)
    tokens = list(range(45))
    donor = FakeSeq(list(tokens))
    assert world.admit(donor)
    window, entries = donor.block_tables
    assert len(entries.ids) == 3  # ceil(45 / 16): allocated with the window's first token
    world.check()
    donor_entries = list(entries.ids)
    world.bm.free_sequence(donor)
    # 44 tokens are reusable block by block, but the entry block 2 (tokens 32..47) is only partly filled:
    # the hit stops at 32, where every compressed block it brings is full.
    again = FakeSeq(list(tokens))
    assert world.admit(again)
    assert again.num_cached_tokens == 32 and again.block_tables[1].ids[:2] == donor_entries[:2]
    world.check()
    short = FakeSeq(list(tokens[:20]) + [99])  # shares 20 tokens: one whole compressed block
    assert world.admit(short)
    assert short.num_cached_tokens == 16 and short.block_tables[1].ids[0] == donor_entries[0]
    world.check()


def test_with_copy_block_a_hit_ends_inside_a_compressed_block_and_gets_its_rows_copied():
    world = World([SlidingWindowSpec(WINDOW), CompressedSpec(ratio=4)], copying=True)
    tokens = list(range(45))
    donor = FakeSeq(list(tokens))
    assert world.admit(donor)
    donor_entries = list(donor.block_tables[1].ids)
    world.bm.free_sequence(donor)
    again = FakeSeq(list(tokens[:42]) + [99, 98, 97])  # shares 42 tokens: token blocks 0..9
    assert world.admit(again)
    # 40 tokens: whole entry blocks 0 and 1 shared, block 2's rows for tokens 32..39 copied into its own.
    assert again.num_cached_tokens == 40
    entries = again.block_tables[1].ids
    assert entries[:2] == donor_entries[:2] and entries[2] != donor_entries[2]
    world.check()  # every row the sequence reads, the copied ones included, holds its own tokens
