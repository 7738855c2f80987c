"""The engine core behind its message boundary: what it sends survives msgpack unchanged, so a front
end over the wire produces exactly the offline outputs; the caller's EngineConfig is left as given."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from llmpipe import LLM, SamplingParams
from llmpipe.config import EngineConfig
from llmpipe.engine.core_messages import EngineCoreOutputs, EngineCoreRequest
from llmpipe.engine.engine import LLMEngine

REQUESTS = [
    ("greedy", [1, 5, 9, 13], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)),
    ("seeded-n2", [1, 200, 17], SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=10, ignore_eos=True)),
    ("stop-token", [1, 42, 43], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[], min_tokens=2)),
    ("prompt-logprobs", [1, 7, 99, 250, 31], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)),
]


def run(engine: LLMEngine) -> dict[str, object]:
    for request_id, prompt, params in REQUESTS:
        engine.add_request(request_id, prompt, dataclasses.replace(params))
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def comparable(output) -> list:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
            for c in output.outputs] + [output.prompt_logprobs]


def test_outputs_through_msgpack_equal_the_in_process_ones(tiny_checkpoint):
    path = str(tiny_checkpoint("llama_gqa"))
    direct = run(LLM(path, progress=False).engine)
    wired = LLM(path, progress=False).engine
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(EngineCoreOutputs).decode
    step, add = wired.core.step, wired.core.add_request
    wired.core.step = lambda: decode(encode(step()))
    wired.core.add_request = lambda request: add(msgspec.msgpack.Decoder(EngineCoreRequest).decode(encode(request)))
    over_the_wire = run(wired)
    assert direct.keys() == over_the_wire.keys() == {r[0] for r in REQUESTS}
    for request_id in direct:
        assert comparable(direct[request_id]) == comparable(over_the_wire[request_id])
        assert direct[request_id].outputs[0].token_ids  # something was generated
    assert len(over_the_wire["prompt-logprobs"].prompt_logprobs) == 5  # they crossed too


def test_a_stop_string_ends_the_sample_in_the_front_end_and_the_core_lets_it_go(tiny_checkpoint):
    """The core knows no text: the output processor matches the stop string, trims the text, and
    aborts the sample in the core, whose blocks are free at once."""
    path = str(tiny_checkpoint("llama_gqa"))
    llm = LLM(path, progress=False)
    free = llm.engine.stats().num_free_blocks
    probe = llm.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    stop = probe.text[len(probe.text) // 2 :][:2]
    if not stop.strip():
        pytest.skip("the tiny model's text has no printable stop string here")
    out = llm.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    first = probe.text.index(stop)
    assert out.outputs[0].text == probe.text[:first] and out.outputs[0].stop_reason == stop
    assert out.outputs[0].finish_reason == "stop"
    assert not llm.engine.core.requests and llm.engine.stats().num_free_blocks == free


def test_the_callers_engine_config_is_not_changed(tiny_checkpoint):
    config = EngineConfig.from_kwargs(model=str(tiny_checkpoint("llama_gqa")), max_model_len=None)
    before = dataclasses.asdict(config)
    engine = LLMEngine(config, progress=False)
    assert dataclasses.asdict(config) == before
    assert config.model_config is None and config.max_model_len is None
    assert engine.config.max_model_len is not None and engine.config.model_config is not None


def test_step_costs_cap_a_step_to_the_allowed_stall_of_the_batch_waiting_to_decode():
    from llmpipe.engine.step_costs import MIN_PREFILL_CHUNK, StepCosts

    costs = StepCosts(max_stall=2.0, max_num_seqs=128)
    assert costs.prefill_budget(num_decodes=8, num_sequences=8) == 0  # nothing measured: this step measures
    assert costs.prefill_budget(num_decodes=0, num_sequences=8) is None  # nothing decodes: no cap
    costs.observe(num_rows=8, seconds=0.100)  # a step of 8 rows: 100 ms
    costs.observe(num_rows=208, seconds=0.500)  # of 208: 500 ms, 2 ms a row past 8
    assert costs.cost(58) == pytest.approx(0.200)  # interpolated
    assert costs.cost(416) == pytest.approx(1.000)  # in proportion past the largest
    assert costs.cost(4) == pytest.approx(0.050)  # and below the smallest
    # 2 x a step of 8 rows = 200 ms: 58 rows, 50 of them prefill beside 8 decodes
    assert costs.prefill_budget(num_decodes=8, num_sequences=8) == 50
    # 24 running or waiting but 8 decoding: the reference is a decode step of 24 (132 ms), and as 16
    # wait for the 8 that decode, 2 x 16 / 8 x 132 ms = 528 ms, 208 x 528 / 500 = 219 rows (in
    # proportion past the largest step): the cap grows with the queue instead of shrinking with the decodes
    assert costs.prefill_budget(num_decodes=8, num_sequences=24) == 211
    assert costs.prefill_budget(num_decodes=12, num_sequences=24) == 90 - 12  # as many wait as decode: 2 x 132 ms
    assert costs.prefill_budget(num_decodes=24, num_sequences=24) == 90 - 24
    costs.observe(num_rows=8, seconds=0.001)
    assert costs.prefill_budget(num_decodes=8, num_sequences=8) >= MIN_PREFILL_CHUNK
    assert StepCosts(max_stall=None, max_num_seqs=128).prefill_budget(8, 8) is None



def test_step_costs_stop_a_burst_at_the_stall_of_a_full_batch():
    """However many wait (one request's list of 256 prompts), a step beside decodes takes at most
    max_stall x a decode step of max_num_seqs: the reference already grows with the queue."""
    from llmpipe.engine.step_costs import StepCosts

    costs = StepCosts(max_stall=2.5, max_num_seqs=128)
    for rows in (1, 16, 128, 2048):
        costs.observe(rows, 0.010 + 0.001 * rows)
    # one stream, the batch limit waiting: 2.5 x 138 ms = 345 ms, 335 rows (before: 2.5 x 127 x 138 ms)
    assert costs.prefill_budget(num_decodes=1, num_sequences=128) == 335 - 1
    # a small burst, under that ceiling, as before: 2.5 x 3 / 1 x 14 ms = 105 ms, ~95 rows (floats round down)
    assert 93 <= costs.prefill_budget(num_decodes=1, num_sequences=4) <= 95 - 1

def test_step_costs_stop_where_a_measured_step_costs_more_than_the_next():
    """A cost that jumps (a kernel change past some batch size) is not interpolated across."""
    from llmpipe.engine.step_costs import StepCosts

    costs = StepCosts(max_stall=2.0, max_num_seqs=128)
    for rows, seconds in ((32, 0.090), (40, 0.250), (64, 0.240), (128, 0.400)):
        costs.observe(rows, seconds)
    assert costs.rows_within(0.180) == 32 + int(8 * (0.180 - 0.090) / 0.160)
    assert costs.rows_within(0.245) == 32 + int(8 * (0.245 - 0.090) / 0.160)
    assert costs.rows_within(0.300) == 64 + int(64 * 0.060 / 0.160)
    assert costs.rows_within(0.800) == 256


def test_the_scheduler_caps_prefill_only_in_steps_that_decode(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama_gqa")), progress=False)
    engine = llm.engine
    engine.add_request("running", [1, 5, 9], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()  # its prefill: it decodes from now on
    engine.add_request("new", list(range(3, 103)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    batch = engine.core.scheduler.schedule(prefill_budget=lambda num_decodes, num_sequences: 16)
    assert len(batch.decodes) == 1 and [item.num_tokens for item in batch.prefills] == [16]
    alone = LLM(str(tiny_checkpoint("llama_gqa")), progress=False).engine
    alone.add_request("new", list(range(3, 103)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    # nothing decodes: the whole prompt
    batch = alone.core.scheduler.schedule(prefill_budget=lambda num_decodes, num_sequences: 16)
    assert not batch.decodes and [item.num_tokens for item in batch.prefills] == [100]
