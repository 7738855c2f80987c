"""transformers as the reference for what the server returns: greedy tokens, their logprobs, their text."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-3


@dataclass
class Greedy:
    token_ids: list[int]
    logprobs: torch.Tensor  # [steps, vocab] log-softmax of each step's logits


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> Greedy:
    """Greedy decoding with transformers' forward and cache, EOS sampled like any token (ignore_eos):
    generate() would ban EOS under min_new_tokens instead."""
    tokens, steps, cache = torch.tensor([prompt_ids]), [], None
    for _ in range(max_new_tokens):
        out = model(tokens, cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits[0, -1].float().log_softmax(-1))
        tokens = steps[-1].argmax().view(1, 1)
    logprobs = torch.stack(steps)
    return Greedy(logprobs.argmax(-1).tolist(), logprobs)


def token_ids_of(logprob_tokens: list[str]) -> list[int]:
    """Ids back from vLLM's return_tokens_as_token_ids format ("token_id:123")."""
    return [int(token.removeprefix("token_id:")) for token in logprob_tokens]


def assert_greedy_matches(ours: list[int], ref: Greedy, near_tie: float = NEAR_TIE) -> None:
    """Equal tokens, or a first difference where transformers' top-2 margin is a near tie
    (batch composition changes float rounding; a near tie may then go either way)."""
    step = next((i for i, (a, b) in enumerate(zip(ours, ref.token_ids)) if a != b), None)
    if step is None:
        assert ours == ref.token_ids[: len(ours)] and len(ours) == len(ref.token_ids)
        return
    top2 = ref.logprobs[step].topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin < near_tie, f"diverged at step {step} where transformers' top-2 margin is {margin:.5f}"
