"""DeepSeek V4 (window + CSA + HCA attention, MoE, hyper-connections) against transformers on the tiny
random-weight checkpoint of tests/conftest.py: window 8, CSA ratio 4, HCA ratio 16, 200-token prompts
(50 CSA entries, of which the indexer keeps 4; 12 HCA entries), float32. Prefill, decode, chunked
prefill, batching, prefix caching and preemption all run through the engine's paged compressed cache."""

import random

import pytest
import torch

from llmpipe import LLM, SamplingParams
from tests.engine_helpers import assert_no_leak, reference_greedy

STEPS = 24


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 320) for _ in range(length)]


PROMPT = prompt(200, 0)


@pytest.fixture(scope="module")
def path(tiny_deepseek_v4):
    return tiny_deepseek_v4()


@pytest.fixture(scope="module")
def reference(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), progress=False)


def greedy(steps: int = STEPS, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, **extra)


def test_prefill_logits_match_transformers(llm, reference):
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(llm.engine.score(PROMPT), theirs, atol=1e-4, rtol=0)


def test_decode_logits_and_greedy_tokens_across_compression_boundaries_match_transformers(llm, reference):
    vocab = llm.engine.config.model_config.vocab_size
    out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(logprobs=vocab))[0].outputs[0]
    expected, logits = reference_greedy(reference, PROMPT, STEPS)
    assert out.token_ids == expected  # 24 steps: positions 200..223 close 6 CSA windows and one HCA window
    ours = torch.tensor([[entry[t].logprob for t in range(vocab)] for entry in out.logprobs])
    torch.testing.assert_close(ours, logits.log_softmax(-1), atol=1e-4, rtol=0)
    assert_no_leak(llm)


def test_every_decode_step_equals_a_full_recompute(llm):
    vocab = llm.engine.config.model_config.vocab_size
    out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(logprobs=vocab))[0].outputs[0]
    for step, entry in enumerate(out.logprobs):
        recomputed = llm.engine.score(PROMPT + out.token_ids[:step])[-1].log_softmax(-1)
        torch.testing.assert_close(torch.tensor([entry[t].logprob for t in range(vocab)]), recomputed, atol=1e-5, rtol=0)


def test_chunked_prefill_and_batching_match_transformers(path, reference):
    prompts = [prompt(n, seed) for seed, n in enumerate([200, 37, 131, 90])]
    llm = LLM(str(path), max_num_batched_tokens=24, progress=False)  # chunks of ≤ 24 tokens, cut off-boundary
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16))
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(reference, p, 16)[0]
    assert_no_leak(llm)


def test_n_samples_share_the_prompt_blocks_and_copy_the_partial_ones(llm, reference):
    out = llm.generate([{"prompt_token_ids": PROMPT[:150]}], greedy(12, n=3))[0]
    expected = reference_greedy(reference, PROMPT[:150], 12)[0]
    assert [sample.token_ids for sample in out.outputs] == [expected] * 3
    assert_no_leak(llm)


def test_prefix_cache_hit_inside_compressed_blocks_changes_nothing(path, reference):
    llm = LLM(str(path), progress=False)
    shared = prompt(300, 5)
    first, second = shared + prompt(5, 6), shared + prompt(9, 7)
    llm.generate([{"prompt_token_ids": first}], greedy(4))
    out = llm.generate([{"prompt_token_ids": second}], greedy(12))[0]
    # Every whole 16-token block of the 300 shared tokens: the hit ends inside the HCA and CSA entry
    # blocks (256 and 128 tokens each), whose cached rows are copied into the sequence's own blocks.
    assert out.num_cached_tokens == 288
    assert out.outputs[0].token_ids == reference_greedy(reference, second, 12)[0]
    assert_no_leak(llm)


def test_preemption_under_a_small_pool_recomputes_to_the_same_tokens(path, reference):
    llm = LLM(str(path), max_num_blocks=28, max_num_batched_tokens=32, progress=False)
    prompts = [prompt(n, 10 + i) for i, n in enumerate([120, 100, 140])]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(40))
    assert llm.engine.stats().num_preemptions > 0
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(reference, p, 40)[0]
    assert_no_leak(llm)


def test_speculative_decoding_verifies_and_rolls_back_on_the_compressed_cache(path, reference, tiny_deepseek_v4):
    # The draft is the same architecture with a tighter SwiGLU clamp: it agrees with the target on
    # some tokens, not all, so verification both accepts guesses and rolls rejected ones back
    # (in the target's cache and the draft's), across compression boundaries.
    draft = tiny_deepseek_v4(swiglu_limit=0.3)
    llm = LLM(str(path), speculative_model=str(draft), num_speculative_tokens=3, progress=False)
    out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(20))[0]
    assert out.outputs[0].token_ids == reference_greedy(reference, PROMPT, 20)[0]
    stats = llm.engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_no_leak(llm)
