"""The Llama family against transformers on tiny random-weight checkpoints (float32)."""

import pytest
import torch
import transformers

from llmpipe import LLM, SamplingParams
from tests.utils import TINY_CONFIGS

PROMPT = [1, 17, 250, 33, 91, 5, 160, 77, 300, 12, 64, 128, 3, 99, 201, 45, 18, 260, 7, 150]


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def pair(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LLM(str(path), progress=False), reference


def test_prefill_logits_match_transformers(pair):
    llm, reference = pair
    ours = llm.engine.score(PROMPT)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers_generate(pair):
    llm, reference = pair
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    with torch.no_grad():
        theirs = reference.generate(
            torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
    assert ours == theirs


def test_decode_with_cache_matches_full_recompute(pair):
    """Every decode step's full next-token distribution equals a from-scratch forward's, to float32 rounding: the
    recompute sums in other orders (one GEMM over the sequence; a hybrid's chunked scan against the step's recurrence),
    which on an AVX-512 CPU's PyTorch kernels left a hybrid's log-prob 2e-6 (relative) away (qwen3_5, Sapphire Rapids)."""
    llm, _ = pair
    vocab = llm.engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=vocab)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    full = llm.engine.score(PROMPT + out.token_ids).log_softmax(-1)[len(PROMPT) - 1 : -1]
    stepwise = torch.tensor([[entry[t].logprob for t in range(vocab)] for entry in out.logprobs])
    torch.testing.assert_close(stepwise, full, atol=1e-5, rtol=1e-5)
