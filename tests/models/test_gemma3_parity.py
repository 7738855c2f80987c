"""Gemma 3 against transformers on a tiny random-weight checkpoint whose window (16) is far shorter
than the prompts (100 tokens): prefill, decode, chunked prefill and batched runs, float32."""

import random

import pytest
import torch
import transformers

from llmpipe import LLM, SamplingParams
from tests.engine_helpers import reference_greedy

NEAR_TIE = 1e-3  # a top-2 logit margin this small may flip on float rounding


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(5, 320) for _ in range(length - 1)]


PROMPT = prompt(100, 0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("gemma3")


@pytest.fixture(scope="module")
def reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), progress=False)


def assert_matches_reference(reference, tokens: list[int], output) -> None:
    """Identical greedy tokens, or a first difference where transformers' top-2 margin is a near-tie."""
    expected, logits = reference_greedy(reference, tokens, len(output.token_ids))
    step = next((i for i, (a, b) in enumerate(zip(output.token_ids, expected)) if a != b), None)
    if step is not None:
        top2 = logits[step].topk(2).values
        assert top2[0] - top2[1] < NEAR_TIE, f"diverged at step {step}, margin {top2[0] - top2[1]:.4f}"


def test_config_has_local_and_global_layers_with_the_window(llm, reference):
    cfg = llm.engine.config.model_config
    assert cfg.layer_types == tuple(reference.config.layer_types)
    assert [cfg.layer_window(i) for i in range(6)] == [16] * 5 + [None]
    assert cfg.rope_local_theta == 1000.0 and cfg.rope_theta == 100000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.query_pre_attn_scalar == 24 and cfg.final_logit_softcapping == 5.0


def test_prefill_logits_match_transformers(llm, reference):
    ours = llm.engine.score(PROMPT)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_decode_logits_and_32_greedy_tokens_match_transformers(llm, reference):
    vocab = llm.engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=vocab)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    expected, logits = reference_greedy(reference, PROMPT, 32)
    assert out.token_ids == expected
    ours = torch.tensor([[entry[t].logprob for t in range(vocab)] for entry in out.logprobs])
    torch.testing.assert_close(ours, logits.log_softmax(-1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [7, 24, 64])
def test_chunked_prefill_matches_transformers(path, reference, chunk):
    """Chunks shorter than, longer than and unaligned to the window and the 16-token blocks."""
    llm = LLM(str(path), progress=False, max_num_batched_tokens=chunk)
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0]
    assert_matches_reference(reference, PROMPT, out)


def test_batched_prompts_of_different_lengths_match_transformers(path, reference):
    batch = [prompt(length, seed) for seed, length in enumerate([100, 37, 150, 9, 64, 120])]
    llm = LLM(str(path), progress=False, max_num_batched_tokens=96)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    for tokens, out in zip(batch, outputs):
        assert_matches_reference(reference, tokens, out.outputs[0])
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks  # every block, window ones included, came back
