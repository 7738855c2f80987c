"""The parity tests every model family's file runs against transformers, on its `case` fixture ((path,
reference model, LLM) of a tiny random checkpoint: tests/utils.py's reference_case): prefill logits,
32 greedy decode steps with their distributions, chunked prefill, and a batch of prompts of different
lengths. A family's test file imports them (`from tests.models.parity_suite import *`) beside its own."""

from __future__ import annotations

from llmpipe import LLM, SamplingParams
from tests.utils import assert_greedy_run_matches, assert_prefill_matches, prompt, reference_greedy

import pytest

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPT = prompt(24, 0)

__all__ = ["GREEDY", "PROMPT", "test_prefill_logits_match_transformers",
           "test_decode_logits_and_32_greedy_tokens_match_transformers", "test_chunked_prefill_matches_transformers",
           "test_batched_prompts_of_different_lengths_match_transformers"]


def test_prefill_logits_match_transformers(case):
    _, reference, llm = case
    assert_prefill_matches(llm, reference, PROMPT)


def test_decode_logits_and_32_greedy_tokens_match_transformers(case):
    _, reference, llm = case
    assert_greedy_run_matches(llm, PROMPT, reference_greedy(reference, PROMPT))


def assert_prefix_hits_and_preemption_keep_the_reference(case, max_num_blocks: int) -> None:
    """Prompts sharing a 32-token prefix (hits after the first), in a pool of `max_num_blocks` blocks of 16, too
    small for all of them at once (preempted and recomputed): each continuation is still transformers'."""
    path, reference, _ = case
    shared = prompt(32, 11)
    batch = [shared + prompt(6, 20 + i)[1:] for i in range(4)]
    llm = LLM(str(path), progress=False, block_size=16, max_num_blocks=max_num_blocks, enable_prefix_caching=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    for tokens, out in zip(batch, outputs):
        assert out.outputs[0].token_ids == reference_greedy(reference, tokens)[0]
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


def like(case, **options) -> LLM:
    """Another LLM of the case's checkpoint, its activations met as the case's LLM meets them."""
    path, _, llm = case
    return LLM(str(path), progress=False, activation_quantization=llm.engine.config.activation_quantization, **options)


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_matches_transformers(case, chunk):
    _, reference, _ = case
    llm = like(case, max_num_batched_tokens=chunk)
    assert_greedy_run_matches(llm, PROMPT, reference_greedy(reference, PROMPT))


def test_batched_prompts_of_different_lengths_match_transformers(case):
    """Prefill chunks and decode rows of several sequences in one step; every block back in the pool after."""
    _, reference, _ = case
    batch = [prompt(length, seed) for seed, length in enumerate([24, 9, 30, 17, 3])]
    llm = like(case, max_num_batched_tokens=40)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    for tokens, out in zip(batch, outputs):
        assert out.outputs[0].token_ids == reference_greedy(reference, tokens)[0]
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
