"""The engine core: batched runs equal solo runs, preemption, prefix caching, chunked prefill, no leaks."""

import random

import pytest

from llmpipe import LLM, InvalidRequestError, SamplingParams
from tests.engine_helpers import assert_no_leak, assert_same_up_to_near_tie, prompts


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return str(tiny_checkpoint("llama_gqa"))


@pytest.fixture(scope="module")
def solo_llm(path):
    return LLM(path, progress=False)


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)


def solo_runs(llm, batch, params):
    return [llm.generate([p], params)[0] for p in batch]


def test_batched_greedy_equals_each_prompt_alone(path, solo_llm):
    batch = prompts(32, (5, 700))
    llm = LLM(path, progress=False, max_num_batched_tokens=512)
    together = llm.generate(batch, GREEDY)
    assert_same_up_to_near_tie(together, solo_runs(solo_llm, batch, GREEDY))
    assert_no_leak(llm)


def test_seeded_sampling_does_not_depend_on_the_batch(path, solo_llm):
    batch = prompts(8, (5, 60), seed=1)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True, logprobs=2)
    together = LLM(path, progress=False).generate(batch, params)
    assert_same_up_to_near_tie(together, solo_runs(solo_llm, batch, params))


def test_preemption_under_a_small_cache_loses_nothing(path, solo_llm):
    batch = prompts(8, (60, 120), seed=2)
    small = LLM(path, progress=False, max_num_blocks=40, block_size=16)
    outputs = small.generate(batch, GREEDY)
    assert small.engine.stats().num_preemptions > 0
    assert [len(o.outputs[0].token_ids) for o in outputs] == [32] * 8
    assert_same_up_to_near_tie(outputs, solo_runs(solo_llm, batch, GREEDY))
    assert_no_leak(small)


def test_chunked_prefill_equals_one_shot_prefill(path, solo_llm):
    batch = prompts(3, (250, 400), seed=3)
    chunked = LLM(path, progress=False, max_num_batched_tokens=64)
    assert_same_up_to_near_tie(chunked.generate(batch, GREEDY), solo_runs(solo_llm, batch, GREEDY))


def test_prefix_cache_computes_only_the_suffix_and_changes_nothing(path):
    rng = random.Random(4)
    prefix = [rng.randrange(3, 300) for _ in range(256)]
    first = {"prompt_token_ids": prefix + [11, 12, 13]}
    second = {"prompt_token_ids": prefix + [21, 22, 23, 24, 25]}
    llm = LLM(path, progress=False)
    llm.generate([first], GREEDY)
    before = llm.engine.stats().num_prefill_tokens
    cached = llm.generate([second], GREEDY)[0]
    assert llm.engine.stats().num_prefill_tokens - before == 5
    assert llm.engine.stats().prefix_cache_hits == 256 // 16
    uncached = LLM(path, progress=False, enable_prefix_caching=False).generate([second], GREEDY)[0]
    assert cached.outputs[0].token_ids == uncached.outputs[0].token_ids


def test_prefix_cache_stays_correct_under_eviction(path, solo_llm):
    batch = prompts(12, (40, 90), seed=5)
    llm = LLM(path, progress=False, max_num_blocks=30)
    # The second round (newest first) hits what survived eviction and recomputes the rest.
    for order in (batch, batch[::-1]):
        for p in order:
            assert_same_up_to_near_tie([llm.generate([p], GREEDY)[0]], [solo_llm.generate([p], GREEDY)[0]])
    assert llm.engine.stats().prefix_cache_hits > 0
    assert_no_leak(llm)


def test_n_samples_share_the_prompt_and_match_separate_seeded_requests(path, solo_llm):
    prompt = prompts(1, (37, 37), seed=6)[0]  # 37 tokens: a partial last block to copy on fork
    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    joint = solo_llm.generate([prompt], SamplingParams(n=3, seed=100, **params))[0]
    separate = [solo_llm.generate([prompt], SamplingParams(seed=100 + i, **params))[0] for i in range(3)]
    assert [o.token_ids for o in joint.outputs] == [s.outputs[0].token_ids for s in separate]
    assert_no_leak(solo_llm)


def test_aborts_mid_prefill_and_mid_decode_free_every_block(path):
    llm = LLM(path, progress=False, max_num_batched_tokens=32)
    engine = llm.engine
    long_prompt, short_prompt = prompts(2, (200, 200), seed=7)
    engine.add_request("prefilling", long_prompt, GREEDY)
    engine.add_request("decoding", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    engine.abort_request("prefilling")
    for _ in range(3):
        engine.step()
    engine.abort_request("decoding")
    assert not engine.has_unfinished_requests()
    assert_no_leak(llm)


def test_prompt_that_can_never_fit_is_rejected_at_add_request(path):
    llm = LLM(path, progress=False, max_num_blocks=4, block_size=16)
    with pytest.raises(InvalidRequestError, match="context limit"):
        llm.engine.add_request("big", {"prompt_token_ids": list(range(3, 103))}, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_stats_report_kv_bytes_per_token(path):
    llm = LLM(path, progress=False)
    cfg = llm.engine.config.model_config
    assert llm.engine.stats().kv_bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
