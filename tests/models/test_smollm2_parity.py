"""The real SmolLM2-135M-Instruct GGUF: greedy output equals transformers' generate on the same file."""

import pytest
import torch

from llmpipe import LLM, SamplingParams
from llmpipe.bench.hf_baseline import load_transformers_model

pytestmark = pytest.mark.slow

PROMPTS = ["How does inference work?", "The capital of France is", None]  # None: a chat-template prompt
NEAR_TIE = 0.01


@pytest.fixture(scope="module")
def models(smollm2_gguf):
    return LLM("smollm2-135m-instruct", progress=False), load_transformers_model(smollm2_gguf, torch.float32)


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


@pytest.mark.parametrize("prompt", PROMPTS, ids=["plain", "plain-short", "chat"])
def test_greedy_64_tokens_match_transformers_up_to_a_near_tie(models, prompt):
    llm, reference = models
    if prompt is None:
        ids = llm.chat_prompt([{"role": "user", "content": "Explain what a KV cache is."}])["prompt_token_ids"]
    else:
        ids = llm.get_tokenizer().encode(prompt)
    ours = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=64))[0]
    with torch.no_grad():
        ref = reference.generate(
            torch.tensor([ids]), max_new_tokens=64, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    theirs = ref.sequences[0, len(ids) :].tolist()
    step = first_divergence(ours.outputs[0].token_ids, theirs)
    if step is not None:
        top2 = ref.logits[step][0].float().topk(2).values
        margin = float(top2[0] - top2[1])
        assert margin < NEAR_TIE, f"diverged at step {step} where transformers' top-2 margin is {margin:.4f}"
    assert len(ours.outputs[0].token_ids) > 0
