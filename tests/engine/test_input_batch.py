"""InputBatch: each sequence's sampling parameters are written to a slot once and gathered by index
each step; what it gathers equals the tensors built from the rows, slots come back when a sequence is
released (the engine leaves none behind), and a batch larger than its capacity grows it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from llmpipe import LLM, SamplingParams
from llmpipe.engine.input_batch import InputBatch
from llmpipe.layers.sampler import SamplingRow, SamplingTensors

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
    SamplingParams(temperature=1.3, min_p=0.05),
    SamplingParams(temperature=0.5, top_k=-1, top_p=0.5, min_p=0.1),
]


class Seq(SimpleNamespace):
    __hash__ = object.__hash__  # by identity, as the engine's Sequence


def seqs(count: int) -> list:
    return [Seq(params=PARAMS[i % len(PARAMS)]) for i in range(count)]


def expected(batch: list) -> SamplingTensors:
    return SamplingTensors.of([SamplingRow(seq.params, None, [], []) for seq in batch])


def assert_same(got: SamplingTensors, want: SamplingTensors) -> None:
    for a, b in zip(got.columns, want.columns):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_gathered_rows_equal_the_rows_own_tensors_in_any_order():
    inputs, batch = InputBatch(capacity=4), seqs(4)
    assert_same(inputs.sampling_tensors(batch), expected(batch))
    shuffled = [batch[2], batch[0], batch[3]]
    assert_same(inputs.sampling_tensors(shuffled), expected(shuffled))
    assert len(inputs.slots) == 4  # each written once


def test_released_slots_are_reused_and_a_full_batch_grows():
    inputs, batch = InputBatch(capacity=2), seqs(2)
    inputs.sampling_tensors(batch)
    inputs.release(batch[0])
    newcomer = seqs(3)[2]
    assert_same(inputs.sampling_tensors([newcomer, batch[1]]), expected([newcomer, batch[1]]))
    assert set(inputs.slots.values()) == {0, 1}  # the freed slot, not a new one
    many = seqs(9)
    assert_same(inputs.sampling_tensors([*many, batch[1], newcomer]), expected([*many, batch[1], newcomer]))
    assert len(inputs.tensors.greedy) >= 11 and len(set(inputs.slots.values())) == 11


def test_the_engine_frees_every_slot_its_requests_took(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama_gqa")), progress=False)
    prompts = [[1, 5, 9], [1, 200, 17, 4], [1, 42]]
    params = [dataclasses.replace(p, max_tokens=6, ignore_eos=True, seed=3) for p in PARAMS[:3]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(n=3, temperature=0.8, max_tokens=4))
    assert llm.engine.core.executor.sampler.input_batch.slots == {}
