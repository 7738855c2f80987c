"""SamplingParams.prompt_logprobs (vLLM's): every prompt token's logprob, rank and top-N equal
transformers' log-softmax on the same weights (float32), whole or in prefill chunks, with the
prefix cache warm, and for n > 1."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmpipe import LLM, InvalidRequestError, SamplingParams

PROMPT = [1, 17, 250, 33, 91, 5, 160, 77, 300, 12, 64, 128, 3, 99, 201, 45, 18, 260, 7, 150] * 2
TOP_N = 3
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama_gqa"))


@pytest.fixture(scope="module")
def reference(path) -> tuple[torch.Tensor, transformers.PreTrainedTokenizerBase]:
    """transformers' log-softmax at every prompt position, and its tokenizer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    return logprobs, transformers.AutoTokenizer.from_pretrained(path)


def assert_matches_reference(prompt_logprobs, reference, top_n: int = TOP_N) -> None:
    logprobs, tokenizer = reference
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(PROMPT)
    assert prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        token, expected = PROMPT[position], logprobs[position - 1]
        entry = prompt_logprobs[position]
        top = expected.topk(top_n)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for tid, lp in entry.items():
            assert abs(lp.logprob - float(expected[tid])) <= TOLERANCE, (position, tid)
            assert lp.rank == int((expected > expected[tid]).sum()) + 1
            assert lp.decoded_token == tokenizer.decode([tid], skip_special_tokens=False)


def prompt_logprobs_of(llm: LLM, **params) -> tuple[list, int]:
    output = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2, prompt_logprobs=TOP_N, **params))[0]
    return output.prompt_logprobs, output.num_cached_tokens


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 8}], ids=["one-prefill", "chunked-prefill"])
def test_prompt_logprobs_equal_transformers_log_softmax(path, reference, options):
    llm = LLM(path, progress=False, **options)
    prompt_logprobs, _ = prompt_logprobs_of(llm, temperature=0.0)
    assert_matches_reference(prompt_logprobs, reference)


def test_a_warm_prefix_cache_does_not_skip_the_positions_asked_for(path, reference):
    llm = LLM(path, progress=False, block_size=8)
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1))  # caches the prompt's blocks
    warm = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1))[0]
    assert warm.num_cached_tokens > 0 and warm.prompt_logprobs is None  # the cache is warm; not asked for
    prompt_logprobs, cached = prompt_logprobs_of(llm, temperature=0.0)
    assert cached == 0
    assert_matches_reference(prompt_logprobs, reference)


def test_n_samples_share_one_set_of_prompt_logprobs(path, reference):
    llm = LLM(path, progress=False)
    output = llm.generate([{"prompt_token_ids": PROMPT}],
                          SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=0))[0]
    assert len(output.outputs) == 3
    logprobs, _ = reference
    expected = [None] + [float(logprobs[p - 1, PROMPT[p]]) for p in range(1, len(PROMPT))]
    assert [None] + [list(entry) for entry in output.prompt_logprobs[1:]] == [None] + [[t] for t in PROMPT[1:]]
    got = [None] + [entry[PROMPT[p]].logprob for p, entry in enumerate(output.prompt_logprobs) if p]
    assert got[0] is None and all(abs(a - b) <= TOLERANCE for a, b in zip(got[1:], expected[1:]))


def test_prompt_logprobs_must_be_non_negative():
    with pytest.raises(Exception, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("budget", [4096, 16], ids=["final-chunk", "earlier-chunk"])
def test_failing_prompt_logprobs_fail_every_sample_of_that_request_alone(path, monkeypatch, budget):
    """n > 1 samples start from sample 0's blocks: when its prompt logprobs fail, the whole request
    fails (no sibling forked from freed blocks, none left waiting forever); the others go on."""
    from llmpipe.engine import token_sampler

    def failing(logprobs, targets, n):
        raise RuntimeError("injected")

    llm = LLM(path, progress=False, max_num_batched_tokens=budget)
    monkeypatch.setattr(token_sampler, "ranked_logprobs", failing)
    engine = llm.engine
    engine.add_request("bad", PROMPT, SamplingParams(n=2, max_tokens=4, prompt_logprobs=1, temperature=0.0))
    engine.add_request("good", PROMPT[:6], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    finished = {}
    for _ in range(64):  # a hang guard: both finish within a few steps
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
        if not engine.has_unfinished_requests():
            break
    assert [c.finish_reason for c in finished["bad"].outputs] == ["error", "error"]
    assert all("prompt logprobs" in c.error for c in finished["bad"].outputs)
    assert len(finished["good"].outputs[0].token_ids) == 4
    assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_blocks


def test_more_logprobs_than_the_vocabulary_has_is_refused(path):
    llm = LLM(path, progress=False)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=name):
            llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**{name: 10**6}), use_tqdm=False)
