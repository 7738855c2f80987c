"""Helpers shared by the engine tests: random prompts, greedy comparison up to near ties, leak checks,
transformers' greedy continuation."""

import random

import torch

NEAR_TIE = 1e-3


def prompts(count: int, lengths: tuple[int, int], seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(*lengths))]} for _ in range(count)]


def assert_same_up_to_near_tie(batched, solo) -> None:
    """Token lists equal, or first differing where the solo run's top-2 logit margin is < NEAR_TIE."""
    for b, s in zip(batched, solo):
        ours, ref = b.outputs[0], s.outputs[0]
        step = next((i for i, (x, y) in enumerate(zip(ours.token_ids, ref.token_ids)) if x != y), None)
        if step is None:
            assert ours.token_ids == ref.token_ids
            continue
        top = sorted((lp.logprob for lp in ref.logprobs[step].values()), reverse=True)
        assert top[0] - top[1] < NEAR_TIE, f"diverged at step {step} with margin {top[0] - top[1]}"


def assert_no_leak(llm) -> None:
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.kv_cache_usage == 0.0
    assert stats.peak_blocks_in_use > 0
    assert stats.num_running == 0 and stats.num_waiting == 0


def reference_greedy(reference, tokens: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (generate, decoding on its own cache) and its logits [steps, vocab]."""
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([tokens]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences[0, len(tokens) :].tolist(), torch.cat(out.logits)
