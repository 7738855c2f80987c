"""Speculative decoding inside the engine: greedy output unchanged for every proposer and k, alone
and batched; stops inside an accepted run; no leaked blocks in either cache; aborts."""

import random

import pytest

from llmpipe import LLM, SamplingParams
from tests.engine_helpers import assert_no_leak, assert_same_up_to_near_tie

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
KS = range(1, 7)


def echo_prompts(count: int, seed: int = 0) -> list[dict]:
    """Random tokens with a repeated stretch, so prompt lookup finds something to propose."""
    rng = random.Random(seed)
    batch = []
    for _ in range(count):
        stretch = [rng.randrange(3, 300) for _ in range(rng.randint(4, 12))]
        filler = [rng.randrange(3, 300) for _ in range(rng.randint(2, 30))]
        batch.append({"prompt_token_ids": stretch + filler + stretch[: rng.randint(2, len(stretch))]})
    return batch


PROMPTS = echo_prompts(32)


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return str(tiny_checkpoint("llama_gqa"))


@pytest.fixture(scope="module")
def reference(target):
    llm = LLM(target, progress=False)
    return llm, llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def proposer_options(name: str, tiny_checkpoint, target: str) -> dict:
    """ngram: prompt lookup. int4_self: the target's own weights in INT4 (mostly accepted).
    other_model: an unrelated random model with the same tokenizer (mostly rejected)."""
    return {
        "ngram": dict(speculative_method="ngram", prompt_lookup_min=1),
        "int4_self": dict(speculative_model=target, speculative_quantization="int4", group_size=32),
        "other_model": dict(speculative_model=str(tiny_checkpoint("qwen2"))),
    }[name]


def spec_llm(target: str, options: dict, k: int) -> LLM:
    return LLM(target, progress=False, num_speculative_tokens=k, **options)


def assert_no_draft_leak(llm: LLM) -> None:
    assert_no_leak(llm)
    proposer = llm.engine.core.proposer
    if hasattr(proposer, "blocks"):
        assert not proposer.shadows and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


@pytest.mark.parametrize("proposer, ks", [("ngram", KS), ("int4_self", KS), ("other_model", (2, 5))])
def test_greedy_batched_equals_no_speculation_for_every_k(tiny_checkpoint, target, reference, proposer, ks):
    _, expected = reference
    for k in ks:
        llm = spec_llm(target, proposer_options(proposer, tiny_checkpoint, target), k)
        assert_same_up_to_near_tie(llm.generate(PROMPTS, GREEDY, use_tqdm=False), expected)
        stats = llm.engine.stats().spec_decode
        assert stats.num_drafts > 0 and 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
        assert_no_draft_leak(llm)


@pytest.mark.parametrize("proposer", ["ngram", "int4_self"])
def test_greedy_alone_equals_no_speculation(tiny_checkpoint, target, reference, proposer):
    _, expected = reference
    for k in KS:
        llm = spec_llm(target, proposer_options(proposer, tiny_checkpoint, target), k)
        chosen = range(k - 1, len(PROMPTS), len(KS))  # every prompt alone once, at one of the k
        assert_same_up_to_near_tie([llm.generate([PROMPTS[i]], GREEDY)[0] for i in chosen], [expected[i] for i in chosen])
        assert_no_draft_leak(llm)


@pytest.fixture(scope="module")
def self_draft(target):
    """Draft = target: every guess is accepted, so stops land inside accepted runs."""
    return LLM(target, progress=False, speculative_model=target, num_speculative_tokens=5)


def test_max_tokens_and_stop_token_inside_an_accepted_run(self_draft, reference):
    _, expected = reference
    full = expected[0].outputs[0].token_ids
    out = self_draft.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == full[:7] and out.finish_reason == "length"
    stop = full[8]
    out = self_draft.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == full[: full.index(stop) + 1] and out.finish_reason == "stop"
    assert_no_draft_leak(self_draft)


def test_penalties_and_logprobs_apply_per_speculative_position(target, self_draft):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5, logprobs=3)
    plain = LLM(target, progress=False).generate(PROMPTS[:4], params, use_tqdm=False)
    spec = self_draft.generate(PROMPTS[:4], params, use_tqdm=False)
    for a, b in zip(spec, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ours, ref in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert ours.keys() == ref.keys()
            assert all(abs(ours[t].logprob - ref[t].logprob) < 1e-4 for t in ref)


def test_abort_mid_run_frees_both_caches(self_draft):
    engine = self_draft.engine
    engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0.8, max_tokens=50, seed=3))
    engine.add_request("b", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.core.proposer.shadows
    engine.abort_request("a")
    engine.abort_request("b")
    assert_no_draft_leak(self_draft)
