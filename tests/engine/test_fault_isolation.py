"""One request's fault fails that request alone: the others in its batch finish with transformers'
greedy tokens. A request is built to fail at each stage: admission, sampling, detokenizing, stop checking."""

import pytest
import torch
import transformers

from llmpipe import LLM, InvalidRequestError, SamplingParams
from tests.engine_helpers import assert_no_leak, reference_greedy

STEPS = 12
GOOD_PROMPTS = [[1, 5, 9, 15], [1, 22, 7], [1, 40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return str(tiny_checkpoint("llama_gqa"))


@pytest.fixture(scope="module")
def expected(path):
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [reference_greedy(reference, prompt, STEPS)[0] for prompt in GOOD_PROMPTS]


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, **extra)


def fail_on_third_call(obj, name: str) -> None:
    """Make obj.name raise on its third call (a fault inside one request's own state)."""
    original, calls = getattr(obj, name), []

    def faulty(*args):
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError(f"injected fault in {name}")
        return original(*args)

    setattr(obj, name, faulty)


@pytest.mark.parametrize(
    "field,params",
    [
        ("stop_token_ids", greedy(stop_token_ids=[10**9], min_tokens=1)),
        ("stop_token_ids", greedy(stop_token_ids=[-1])),
        ("logit_bias", greedy(logit_bias={10**9: 5.0})),
    ],
)
def test_admission_refuses_token_ids_outside_the_vocabulary_naming_the_field(path, field, params):
    llm = LLM(path, progress=False)
    with pytest.raises(InvalidRequestError, match=field) as err:
        llm.engine.add_request("bad", [1, 2, 3], params)
    assert err.value.param == field
    assert not llm.engine.has_unfinished_requests()


def test_requests_failing_at_each_stage_leave_the_batch_exact(path, expected):
    llm = LLM(path, progress=False)
    engine = llm.engine
    for i, prompt in enumerate(GOOD_PROMPTS):
        engine.add_request(f"good{i}", prompt, greedy())
    with pytest.raises(InvalidRequestError):  # admission
        engine.add_request("admission", [1, 2, 3], greedy(stop_token_ids=[10**9], min_tokens=1))

    slipped = greedy(min_tokens=4, stop_token_ids=[7])
    engine.add_request("sampling", [1, 60, 61], slipped)
    slipped.stop_token_ids.append(10**9)  # a bad value that got past validation: the sampler's ban raises
    engine.add_request("detokenizing", [1, 70, 71], greedy())
    fail_on_third_call(engine.output_processor.requests["detokenizing"].samples[0].detokenizer._stream, "step")
    engine.add_request("stop_checking", [1, 80, 81], greedy(stop=["zz"]))
    fail_on_third_call(engine.output_processor.requests["stop_checking"].samples[0].detokenizer._stops, "push")

    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    for i, tokens in enumerate(expected):
        good = finals[f"good{i}"].outputs[0]
        assert good.finish_reason == "length" and good.token_ids == tokens
    for stage, words in [("sampling", "sampling"), ("detokenizing", "text"), ("stop_checking", "text")]:
        failed = finals[stage].outputs[0]
        assert failed.finish_reason == "error" and words in failed.error
    assert len(finals["detokenizing"].outputs[0].token_ids) == 3  # it ended at the token whose text raised
    assert_no_leak(llm)


def test_a_batch_whose_sampling_fails_keeps_seeded_rows_reproducible(path):
    """The fallback samples each row alone; a seeded row draws the same token as without the fault."""
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=STEPS, ignore_eos=True)
    alone = LLM(path, progress=False).generate([{"prompt_token_ids": GOOD_PROMPTS[0]}], seeded)[0]
    llm = LLM(path, progress=False)
    llm.engine.add_request("seeded", GOOD_PROMPTS[0], seeded)
    slipped = greedy(min_tokens=4)
    llm.engine.add_request("sampling", [1, 60, 61], slipped)
    slipped.stop_token_ids.append(10**9)
    finals = {}
    while llm.engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert finals["sampling"].outputs[0].finish_reason == "error"
    assert finals["seeded"].outputs[0].token_ids == alone.outputs[0].token_ids
