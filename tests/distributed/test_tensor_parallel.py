"""tensor_parallel_size=2 (gloo, two processes on loopback) against the single-process engine on the
tiny checkpoints: the same greedy tokens, the same logits to float32 rounding, half the bytes per rank."""

import pytest
import torch

from llmpipe import LLM, SamplingParams
from tests.models.test_llama_parity import PROMPT

# Every architecture (llama_mqa: its one KV head replicated on both ranks); the Qwens with quantized
# weights (int8 with a tied quantized head; int4 g32: down_proj's 112 inputs split 64 + 48 at a
# group boundary). Each case starts two processes, so there are few of them.
CASES = [
    ("llama_mqa", {}), ("mistral_window", {}), ("gemma3", {}),
    ("qwen2", {"quantization": "int8"}), ("qwen3", {"quantization": "int4", "group_size": 32}),
]
# Float activations (the reference path): with the default 16-bit activation blocks, a last-bit
# difference from the all-reduce can move an activation across a rounding boundary.
OPTIONS = dict(progress=False, max_num_blocks=64, dtype="float32", activation_quantization=None)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [1, 44, 55, 66]}]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: "-".join([case[0], *map(str, case[1].values())]))
def pair(request, tiny_checkpoint):
    """(single-process LLM, tensor_parallel_size=2 LLM) on the same checkpoint and options."""
    name, options = request.param
    path = str(tiny_checkpoint(name))
    single = LLM(path, **OPTIONS, **options)
    with LLM(path, tensor_parallel_size=2, distributed_timeout_s=60, **OPTIONS, **options) as parallel:
        yield single, parallel


def assert_same_or_near_tie(single: LLM, prompt: list[int], expected: list[int], actual: list[int]) -> None:
    """Equal tokens, or a first difference where the single-process top-2 logits are within 1e-3
    (all-reduce sums partial products in another order)."""
    step = next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b), None)
    if step is None:
        assert len(expected) == len(actual)
        return
    top2 = single.engine.score(prompt + expected[:step], last_only=True)[0].topk(2).values
    assert top2[0] - top2[1] < 1e-3, f"diverged at step {step} where the margin is {top2[0] - top2[1]:.4f}"


def test_greedy_tokens_match_the_single_process_engine(pair):
    single, parallel = pair
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False)
    actual = parallel.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, ours, theirs in zip(PROMPTS, expected, actual):
        assert_same_or_near_tie(single, prompt["prompt_token_ids"], ours.outputs[0].token_ids, theirs.outputs[0].token_ids)


def test_forked_samples_read_their_copied_block_on_every_rank(pair):
    """n=2 copies the prompt's partial last block to the second sample (on every rank's cache)."""
    single, parallel = pair
    params = SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = single.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs
    actual = parallel.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs
    assert [o.token_ids for o in actual] == [o.token_ids for o in expected]


def test_prefill_logits_match_to_float32_rounding(pair):
    single, parallel = pair
    torch.testing.assert_close(parallel.engine.score(PROMPT), single.engine.score(PROMPT), atol=1e-4, rtol=0)


def test_each_rank_holds_half_the_weights_and_its_kv_heads(pair):
    single, parallel = pair
    ranks = parallel.engine.core.runner.rank_memory()
    full = single.engine.weight_bytes
    for rank in ranks:  # everything is split but the norms (replicated, a few percent of these tiny models)
        assert 0.45 * full <= rank.weight_bytes <= 0.55 * full, (rank, full)
    assert parallel.engine.weight_bytes == ranks[0].weight_bytes
    kv_heads = single.engine.config.model_config.num_key_value_heads
    full_kv = sum(t.numel() * t.element_size() for t in single.engine.core.runner.kv_cache.tensors)
    for rank in ranks:  # the same number of blocks, each holding this rank's KV heads (replicated below 2)
        assert rank.num_blocks == single.engine.core.block_manager.num_blocks
        assert rank.kv_cache_bytes == full_kv * max(1, kv_heads // 2) // kv_heads
    assert parallel.engine.core.block_bytes * kv_heads == single.engine.core.block_bytes * max(1, kv_heads // 2)


def test_embeddings_equal_the_single_process_engines(pair):
    """Pooling under tensor parallelism: rank 0 pools the all-reduced hidden states, as one process does."""
    single, parallel = pair
    expected = torch.tensor([o.outputs.embedding for o in single.embed(PROMPTS, use_tqdm=False)])
    actual = torch.tensor([o.outputs.embedding for o in parallel.embed(PROMPTS, use_tqdm=False)])
    assert torch.nn.functional.cosine_similarity(actual, expected).min() > 1 - 1e-5
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
