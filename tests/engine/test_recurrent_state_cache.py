"""The recurrent-state kind (kv_cache/kinds/recurrent.py) beside full attention, as a hybrid model (Qwen3.5) has them:
the block manager's invariants under random operations, with a fake state pool that records which tokens each
state has consumed, so a prefix hit that restored the wrong checkpoint, a fork that shares a live state, or a
snapshot taken at the wrong boundary shows up as a sequence continuing from a foreign state."""

from hypothesis import given, settings

from llmpipe.engine.block_manager import BlockManager
from llmpipe.kv_cache.kinds import FullAttentionSpec, RecurrentStateSpec, StateTable
from tests.engine.test_block_manager import BLOCK, FakeSeq, World, ops, run_operations

NUM_BLOCKS = 48
SLOTS = 10
STATE = RecurrentStateSpec((6, 3), (2, 4, 4), slots=SLOTS, first_id=NUM_BLOCKS)
SPECS = [FullAttentionSpec(), STATE]


class HybridWorld(World):
    """World's token pool for the attention group; `states` maps a state id to the tokens its state has consumed."""

    def __init__(self, specs=SPECS, num_blocks=NUM_BLOCKS, caching=True):
        self.bm = BlockManager(num_blocks, BLOCK, specs, enable_prefix_caching=caching, copy_partial_blocks=True)
        self.pool: dict[tuple[int, int], int] = {}
        self.states: dict[int, tuple[int, ...]] = {}
        self.live: list[FakeSeq] = []

    def copy(self, src: int, dst: int) -> None:
        if src >= NUM_BLOCKS:
            self.states[dst] = self.states[src]
        else:
            super().copy(src, dst)

    def compute(self, seq: FakeSeq) -> None:
        """The step's tokens: attention rows written, the live state advanced from where it was (a fresh chunk
        starts from nothing), the snapshot slot given the state at its boundary."""
        start, tokens = seq.num_computed_tokens, tuple(seq.tokens)
        attention, state = seq.block_tables
        for pos in range(start, len(tokens)):
            self.pool[(attention.block_of(pos, BLOCK), pos % BLOCK)] = (tokens[pos],)
        live = state.ids[0]
        before = () if start == 0 else self.states[live]
        assert before == tokens[:start], "the step continues from a state of other tokens"
        if state.snapshot_at > start:
            self.states[state.ids[1]] = tokens[: state.snapshot_at]
        self.states[live] = tokens
        seq.num_computed_tokens = len(tokens)
        self.bm.register_full_blocks(seq, seq.num_computed_tokens)
        self.bm.free_unreachable(seq)

    def check(self) -> None:
        pool, states = self.bm.pool, self.bm.groups[1].pool
        refs, state_refs = [0] * NUM_BLOCKS, [0] * SLOTS
        for seq in self.live:
            attention, state = seq.block_tables
            for b in attention.ids:
                refs[b] += 1
            assert len(state.ids) == 1 and state.snapshot_at == -1  # between steps: the live state only
            state_refs[state.ids[0] - NUM_BLOCKS] += 1
            assert self.states[state.ids[0]] == tuple(seq.tokens[: seq.num_computed_tokens])
        assert refs == [b.ref_count for b in pool.blocks]
        assert state_refs == [b.ref_count for b in states.blocks] and all(r <= 1 for r in state_refs)
        for key, state_id in states.cached.items():  # a checkpoint holds exactly the prefix it is listed under
            prefix = self.states[state_id]
            assert len(prefix) % BLOCK == 0 and states.blocks[state_id - NUM_BLOCKS].listed[key] == prefix[-BLOCK:]


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_recurrent_kind_keeps_the_block_manager_invariants(operations):
    world = HybridWorld()
    run_operations(world, operations)
    assert world.bm.groups[1].pool.num_free_blocks == SLOTS


def test_a_second_turn_resumes_from_the_checkpoint_at_the_first_turns_last_boundary():
    world = HybridWorld()
    first = FakeSeq(list(range(10)))  # prefill 10 tokens: a checkpoint at 8
    assert world.admit(first)
    for token in (20, 21, 22):  # decode to 13 tokens: the step to 12 crosses a boundary
        first.tokens.append(token)
        assert world.step(first)
    world.bm.free_sequence(first)
    world.live.clear()
    second = FakeSeq(first.tokens + [30, 31, 32])
    hit = world.bm.prefix_hit(second)
    assert hit.num_tokens == 12 and hit.partials[1] is not None  # the newest checkpoint, copied into its own state
    assert world.admit(second)
    assert world.states[second.block_tables[1].ids[0]] == tuple(second.tokens)
    world.check()


def test_a_hit_needs_both_the_attention_blocks_and_a_checkpoint():
    world = HybridWorld()
    seq = FakeSeq(list(range(9)))  # one chunk: its only checkpoint at 8
    assert world.admit(seq)
    world.bm.free_sequence(seq)
    world.live.clear()
    assert world.bm.prefix_hit(FakeSeq(list(range(13)))).num_tokens == 8  # attention holds 2 blocks; state only at 8
    # A prompt sharing 7 tokens: attention could serve the first block, but no state was checkpointed at 4.
    assert world.bm.prefix_hit(FakeSeq(list(range(7)) + [99, 99])).num_tokens == 0


def test_without_prefix_caching_no_checkpoint_is_taken():
    world = HybridWorld(caching=False)
    seq = FakeSeq(list(range(17)))
    assert world.admit(seq)
    assert seq.block_tables[1].ids and world.bm.states_held(seq) == 1
    assert world.bm.groups[1].pool.num_free_blocks == SLOTS - 1


def test_live_states_bound_the_running_sequences_and_forks_copy_the_state():
    world = HybridWorld(caching=False)
    running = [FakeSeq([i, i + 1, i + 2]) for i in range(SLOTS)]
    assert all(world.admit(seq) for seq in running)
    assert not world.admit(FakeSeq([7, 7, 7]))  # every state is live: the next sequence waits
    assert not world.bm.can_fork(running[0])
    world.bm.free_sequence(running.pop())
    world.live.pop()
    child = FakeSeq(list(running[0].tokens))
    world.bm.fork(running[0], child)
    copies = world.bm.take_block_copies()  # the partial attention block and the state
    assert (running[0].block_tables[1].ids[0], child.block_tables[1].ids[0]) in copies and len(copies) == 2


def test_state_ids_follow_the_token_blocks_and_tables_start_empty():
    world = HybridWorld()
    assert isinstance(world.bm.no_hit().tables[1], StateTable)
    seq = FakeSeq([1, 2, 3])
    assert world.admit(seq)
    assert NUM_BLOCKS <= seq.block_tables[1].ids[0] < NUM_BLOCKS + SLOTS
    assert world.bm.blocks_held(seq) == 1 and world.bm.states_held(seq) == 1
