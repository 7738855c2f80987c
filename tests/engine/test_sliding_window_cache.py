"""Sliding-window KV cache groups: window layers free the blocks their queries no longer reach while a
sequence goes on, full-attention layers keep everything, and outputs stay transformers' (tiny Gemma 3,
window 16 unless stated; block size 16)."""

import json
import shutil

import pytest
import torch
import transformers

from llmpipe import LLM, SamplingParams
from tests.engine_helpers import reference_greedy
from tests.models.test_gemma3_parity import path, prompt, reference  # noqa: F401  (shared fixtures)

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)




@pytest.fixture(scope="module")
def long_window_path(path, tmp_path_factory):
    """The same weights with Gemma 3 270M's window (512) and room for 8K positions."""
    out = tmp_path_factory.mktemp("gemma3_w512")
    shutil.copytree(path, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config.update(sliding_window=512, max_position_embeddings=8192)
    (out / "config.json").write_text(json.dumps(config))
    return out


def assert_matches_reference(reference, tokens: list[int], token_ids: list[int]) -> None:
    expected, logits = reference_greedy(reference, tokens, len(token_ids))
    step = next((i for i, (a, b) in enumerate(zip(token_ids, expected)) if a != b), None)
    if step is not None:
        top2 = logits[step].topk(2).values
        assert top2[0] - top2[1] < 1e-3, f"diverged at step {step}, margin {top2[0] - top2[1]:.4f}"


def window_groups(llm):
    return [g for g, group in enumerate(llm.engine.kv_layout.groups) if group.spec.window is not None]


def assert_no_leak(llm) -> None:
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and not stats.kv_bytes_per_seq


def test_layers_form_full_and_window_groups_of_equal_size(path):
    layout = LLM(str(path), progress=False).engine.kv_layout
    assert [g.spec.name for g in layout.groups] == ["sliding_window(16)"] * 5 + ["full"]
    assert layout.slots_per_block == 1 and layout.layer_groups == (0, 1, 2, 3, 4, 5)


def test_4096_token_sequence_holds_window_blocks_for_at_most_window_plus_a_block(long_window_path):
    """The design's figure: window 512, 4,096-token prompt; decode must not grow the window groups,
    and the blocks they drop go back to the pool."""
    llm = LLM(str(long_window_path), progress=False, max_num_batched_tokens=1024)
    engine = llm.engine
    tokens = prompt(4096, 1)
    engine.add_request("long", {"prompt_token_ids": tokens}, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    windows, full_group = window_groups(llm), llm.engine.kv_layout.groups.index(
        next(g for g in llm.engine.kv_layout.groups if g.spec.window is None))
    in_use = []
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.core.scheduler.running[0] if engine.core.scheduler.running else None
        if seq is None:
            break
        for g in windows:  # between steps: the last 512 keys' blocks (the newest query reads them)
            held = seq.block_tables[g]
            assert len(held.ids) * BLOCK <= 512 + BLOCK
            assert held.offset == max(0, seq.num_computed_tokens - 511) // BLOCK
        assert len(seq.block_tables[full_group].ids) == -(-seq.num_computed_tokens // BLOCK)
        if not seq.in_prefill:
            in_use.append(engine.stats().num_blocks - engine.stats().num_free_blocks)
            assert engine.stats().kv_bytes_per_seq["long"] == engine.kv_bytes_per_sequence(seq.num_computed_tokens)
    # Over 48 decode steps the window groups give back as many blocks as they take (each holds 32 or
    # 33 blocks, by alignment): only the full group's growth, one block per 16 tokens, shows in the pool.
    assert in_use[-1] - in_use[0] <= -(-48 // BLOCK) + 1 + len(windows)
    assert max(in_use) <= -(-(4096 + 48) // BLOCK) + len(windows) * (512 // BLOCK + 1)
    assert_no_leak(llm)


def test_window_bytes_per_sequence_vs_full_attention(long_window_path):
    """KV bytes one 4K sequence holds, reported by the engine, with the window and forced to full attention."""
    windowed = LLM(str(long_window_path), progress=False).engine
    full = LLM(str(long_window_path), progress=False, disable_sliding_window=True).engine
    cfg = windowed.config.model_config
    per_layer_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert full.kv_bytes_per_sequence(4096) == 6 * 4096 * per_layer_token
    # The next query (position 4096) reads keys 3585..4095: blocks 224..255, 32 blocks per window layer.
    assert windowed.kv_bytes_per_sequence(4096) == (4096 + 5 * 32 * BLOCK) * per_layer_token
    assert windowed.stats().kv_bytes_per_token == per_layer_token  # one full-attention layer keeps every token
    assert full.stats().kv_bytes_per_token == 6 * per_layer_token


def test_prefix_cache_with_windows_computes_only_the_suffix_and_matches_transformers(path, reference):
    shared = prompt(200, 2)
    llm = LLM(str(path), progress=False)
    llm.generate([{"prompt_token_ids": shared + [11, 12, 13]}], GREEDY)
    before = llm.engine.stats()
    second = shared + [21, 22, 23, 24, 25]
    out = llm.generate([{"prompt_token_ids": second}], GREEDY)[0].outputs[0]
    after = llm.engine.stats()
    assert after.num_prefill_tokens - before.num_prefill_tokens == len(second) - 192  # 12 full blocks hit
    assert after.prefix_cache_hits - before.prefix_cache_hits == 12
    assert_matches_reference(reference, second, out.token_ids)
    assert_no_leak(llm)


def test_preemption_and_prefix_cache_under_a_small_pool_match_transformers(path, reference):
    batch = [prompt(length, 10 + i) for i, length in enumerate([120, 90, 140, 100, 130, 110])]
    # 6 groups: a 120-token sequence holds 8 full-group blocks + ≤ 2 per window group.
    llm = LLM(str(path), progress=False, max_num_blocks=60, max_num_batched_tokens=64)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    for tokens, out in zip(batch, outputs):
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        assert_matches_reference(reference, tokens, out.outputs[0].token_ids)
    assert_no_leak(llm)


def test_n_samples_fork_window_blocks_and_match_separate_seeded_requests(path):
    llm = LLM(str(path), progress=False)
    tokens = {"prompt_token_ids": prompt(37, 3)}  # a partial last block in every group to copy on fork
    params = dict(temperature=1.0, max_tokens=40, ignore_eos=True)
    joint = llm.generate([tokens], SamplingParams(n=3, seed=100, **params))[0]
    separate = [llm.generate([tokens], SamplingParams(seed=100 + i, **params))[0] for i in range(3)]
    assert [o.token_ids for o in joint.outputs] == [s.outputs[0].token_ids for s in separate]
    assert_no_leak(llm)


def test_recompute_mode_regrows_freed_window_blocks(path, reference):
    llm = LLM(str(path), progress=False, kv_cache=False)
    tokens = prompt(60, 4)
    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert_matches_reference(reference, tokens, out[0].outputs[0].token_ids)
    assert_no_leak(llm)


def test_mistral_window_uses_the_same_path(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("mistral_window")), progress=False)
    engine = llm.engine
    assert [g.spec.name for g in engine.kv_layout.groups] == ["sliding_window(12)"]
    engine.add_request("r", {"prompt_token_ids": prompt(100, 5)}, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for _ in range(10):
        engine.step()
    table = engine.core.scheduler.running[0].block_tables[0]
    assert table.offset > 0 and len(table.ids) <= 2  # 12 keys span at most two 16-token blocks
    assert engine.stats().kv_bytes_per_token == 0  # no layer keeps every token


def test_disable_sliding_window_equals_transformers_with_an_unbounded_window(path):
    """Forced full attention keeps each layer's RoPE base: it is the model with an endless window."""
    unbounded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, sliding_window=4096).eval()
    llm = LLM(str(path), progress=False, disable_sliding_window=True)
    assert [g.spec.name for g in llm.engine.kv_layout.groups] == ["full"]
    tokens = prompt(100, 6)
    with torch.no_grad():
        expected = unbounded(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(llm.engine.score(tokens), expected, atol=1e-4, rtol=0)
