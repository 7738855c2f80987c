"""KV-cache kinds plug in without touching the engine: a kind the engine has never seen (chunked local
attention, as Llama 4's local layers use, written here in a few lines) keeps the block manager's
invariants, and the engine's shared code names no kind and no model."""

import re
from dataclasses import dataclass
from pathlib import Path

from hypothesis import given, settings

from llmpipe.kv_cache.kinds import FullAttentionSpec, SlidingWindowSpec
from tests.engine.test_block_manager import BLOCK, FakeSeq, World, ops, run_operations

ENGINE = Path(__file__).parents[2] / "llmpipe" / "engine"
KV_CACHE = ENGINE.parent / "kv_cache"


@dataclass(frozen=True)
class ChunkedLocalSpec(SlidingWindowSpec):
    """A query reads only the tokens of its own chunk of `window` tokens; the window kind's manager frees
    what first_needed_block leaves behind."""

    @property
    def name(self) -> str:
        return f"chunked_local({self.window})"

    def first_needed_block(self, position: int, block_size: int) -> int:
        return position // self.window * self.window // block_size


SPECS = [FullAttentionSpec(), ChunkedLocalSpec(8)]


@settings(max_examples=200, deadline=None)
@given(ops)
def test_a_kind_the_engine_has_never_seen_keeps_the_block_manager_invariants(operations):
    run_operations(World(SPECS), operations)


def test_the_chunked_kind_holds_only_its_current_chunk_and_prefix_hits_respect_it():
    world = World(SPECS)
    seq = FakeSeq([1] * 5)
    assert world.admit(seq)
    for n in range(6, 41):
        seq.tokens.append(n % 3)
        assert world.step(seq)
        local = seq.block_tables[1]
        assert local.offset == (n - 1) // 8 * 8 // BLOCK  # the newest query's chunk starts here
        assert len(local.ids) <= 8 // BLOCK
    world.bm.free_sequence(seq)
    world.live.clear()
    # The next query (position 36) reads its chunk's first block (tokens 32..35), still cached.
    hit = world.bm.prefix_hit(FakeSeq(list(seq.tokens)))
    assert hit.num_tokens == 36 and hit.tables[1].offset == 8


def _code(path: Path) -> str:
    """A module's code without its docstrings and comments."""
    text = re.sub(r'"""(.|\n)*?"""', "", path.read_text())
    return re.sub(r"#.*", "", text)


def test_the_engine_names_no_kv_cache_kind_and_no_model():
    kinds = re.compile(r"FullAttention|SlidingWindow|Compressed|Recurrent|snapshot|\bratio\b|free_out_of_window", re.IGNORECASE)
    shared = [ENGINE / name for name in ("block_manager.py", "scheduler.py", "core.py", "executor.py", "model_runner.py",
                                         "token_sampler.py")] + [KV_CACHE / "block_pool.py"]
    for path in shared:
        assert not kinds.search(_code(path)), path
    for path in [*ENGINE.rglob("*.py"), *KV_CACHE.rglob("*.py"), ENGINE.parent / "layers" / "attention.py"]:
        if path != KV_CACHE / "kinds" / "compressed.py":
            assert "deepseek" not in path.read_text().lower(), path
