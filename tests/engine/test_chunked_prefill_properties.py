"""Chunked prefill under every token budget, batch mix and weight format: a request's greedy tokens are
those of the same request run alone in one chunk, and no step raises.

A step may carry only prefill chunks that end no prompt (a prompt longer than the budget, alone, or
several prompts sharing the budget): it has no logits row (such a step once reached the
quantized LM head's kernel with 0 rows and failed every request in flight)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmpipe import LLM, SamplingParams
from llmpipe.engine.step_size import STEP_TOKENS
from tests.utils import build_checkpoint
from tests.engine_helpers import NEAR_TIE
from tests.loader.gguf_helpers import hf_metadata, hf_tensors, write_gguf
from tests.models.test_llama_decode_step import with_half_group_down_projections

# Widths multiples of 32 (every GGUF block type and INT8 groups of 16 fit); positions for a prompt past 2,048.
CONFIG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              tie_word_embeddings=False, max_position_embeddings=4096)
# Every block type gguf's Python package quantizes to (Q5_0 kept as the file's blocks); Q4_K and Q6_K load as
# INT4 groups of 32 and INT8 groups of 16, the "int4" and "Q6_K" formats below.
GGUF_TYPES = {
    **{f"model.layers.0.{name}.weight": Q.Q4_1 for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
    **{f"model.layers.0.mlp.{name}.weight": Q.Q4_0 for name in ("gate_proj", "up_proj")},
    "model.layers.0.mlp.down_proj.weight": Q.Q8_0,
    "model.layers.0.self_attn.o_proj.weight": Q.Q5_0,
    **{f"model.layers.1.{name}.weight": Q.Q5_0 for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
    **{f"model.layers.1.mlp.{name}.weight": Q.Q8_0 for name in ("gate_proj", "up_proj", "down_proj")},
    "lm_head.weight": Q.Q8_0,
}
# Every weight format of the tiny checkpoint, with the activations each computes with (auto: 16-bit blocks
# where the kernels run); SmolLM2's GGUF (Q4_1, as `llmpipe serve` runs it by default) below.
FORMATS = {
    "float32": dict(quantization=None),
    "int8": dict(quantization="int8"),
    "int4": dict(quantization="int4", group_size=32, activation_quantization=None),
    "int4, 8-bit activations": dict(quantization="int4", group_size=32, activation_quantization="int8"),
    "int8 groups of 16 (Q6_K)": dict(quantization="int8"),
    "gguf Q4_0/Q4_1/Q5_0/Q8_0": dict(),
}
SMOLLM2 = "smollm2-135m-instruct"
# 8-bit activation blocks are approximate: a float32 rounding that differs with the batch's shape (PyTorch's
# reductions over a few rows or many) can move a code by one, and a logit by ~0.01.
NEAR_TIES = {"int4, 8-bit activations": 0.05}
BUDGETS = (16, 24, 32, 64)  # max_num_batched_tokens
MIXES = ("alone", "beside a decode", "several prompts")
MAX_PROMPT, MAX_TOKENS = 200, 4
ENGINE = dict(progress=False, enable_prefix_caching=False)  # each example computes every token
BLOCKS = {SMOLLM2: 48}  # KV blocks of 16 tokens (SmolLM2's are 1.5 MB each); 256 for the tiny model
EXAMPLES = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint("LlamaConfig", CONFIG, tmp_path_factory.mktemp("tiny_long_context"))


def gguf_file(checkpoint: Path) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tensors = hf_tensors(model.state_dict(), model.config, "llama", GGUF_TYPES)
    return write_gguf(checkpoint / "model.gguf", "llama", hf_metadata(model.config, "llama"), tensors)


class Engines:
    """One LLM per (format, budget), made on first use; budget None: the reference, every prompt one chunk."""

    def __init__(self, checkpoint: Path):
        self.checkpoint, self.gguf, self.llms = checkpoint, None, {}
        self.references: dict[tuple, object] = {}

    def get(self, fmt: str, budget: int | None, blocks: int | None = None) -> LLM:
        if (fmt, budget) not in self.llms:
            self.llms[fmt, budget] = self._build(fmt, budget or 4096, blocks or BLOCKS.get(fmt, 256))
        return self.llms[fmt, budget]

    def _build(self, fmt: str, budget: int, blocks: int) -> LLM:
        path = self.checkpoint
        if fmt == SMOLLM2:
            path = SMOLLM2
        elif fmt.startswith("gguf"):
            self.gguf = self.gguf or gguf_file(self.checkpoint)
            path = self.gguf
        llm = LLM(str(path), max_num_batched_tokens=budget, max_num_blocks=blocks, **FORMATS.get(fmt, {}), **ENGINE)
        return with_half_group_down_projections(llm) if "Q6_K" in fmt else llm

    def alone(self, fmt: str, prompt: list[int], params: SamplingParams):
        """The request alone, its prompt in one chunk (cached: hypothesis repeats prompts as it shrinks)."""
        key = (fmt, tuple(prompt), params.max_tokens)
        if key not in self.references:
            self.references[key] = self.get(fmt, None).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return self.references[key]


@pytest.fixture(scope="module")
def engines(checkpoint) -> Engines:
    return Engines(checkpoint)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


@dataclass
class Case:
    budget: int
    mix: str
    lengths: list[int]
    seed: int

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(3, vocab) for _ in range(n)] for n in self.lengths]


@st.composite
def cases(draw, max_prompt: int = MAX_PROMPT, budgets: tuple[int, ...] = BUDGETS) -> Case:
    budget = draw(st.sampled_from(budgets))
    mix = draw(st.sampled_from(MIXES))
    count = {"alone": 1, "beside a decode": draw(st.integers(1, 2)), "several prompts": draw(st.integers(2, 3))}[mix]
    edges = [n for k in (1, 2) for n in (k * budget - 1, k * budget, k * budget + 1) if n <= max_prompt]
    length = st.integers(1, max_prompt) | st.sampled_from(edges)  # chunks ending just before, on and after a budget
    return Case(budget, mix, draw(st.lists(length, min_size=count, max_size=count)), draw(st.integers(0, 2**16)))


def run_case(llm: LLM, case: Case, vocab: int) -> list[tuple[list[int], SamplingParams, object]]:
    """Every request of the case in one engine, stepped to the end: (prompt, params, output) each. Beside a
    decode, the decoding request is in flight (past its prefill) before the prompts arrive, and long enough
    to decode beside all of their chunks."""
    engine, outputs = llm.engine, {}
    requests = [(p, greedy()) for p in case.prompts(vocab)]
    if case.mix == "beside a decode":
        steps = sum(math.ceil(n / case.budget) for n in case.lengths)
        decoder = ([5, 6, 7], greedy(steps + 2))
        engine.add_request("decoder", {"prompt_token_ids": decoder[0]}, decoder[1])
        outputs.update((o.request_id, o) for o in engine.step())
        assert len(outputs["decoder"].outputs[0].token_ids) == 1
        requests.append(decoder)
    for i, (prompt, params) in enumerate(requests[: len(case.lengths)]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    ids = [str(i) for i in range(len(case.lengths))] + (["decoder"] if case.mix == "beside a decode" else [])
    return [(prompt, params, outputs[i]) for (prompt, params), i in zip(requests, ids)]


def assert_same_up_to_near_tie(fmt: str, output, alone) -> None:
    """Tokens equal, or first differing where the lone run's top-2 logprob margin is below the format's near tie."""
    ours, ref = output.outputs[0], alone.outputs[0]
    step = next((i for i, (x, y) in enumerate(zip(ours.token_ids, ref.token_ids)) if x != y), None)
    if step is not None:
        top = sorted((lp.logprob for lp in ref.logprobs[step].values()), reverse=True)
        assert top[0] - top[1] < NEAR_TIES.get(fmt, NEAR_TIE), f"diverged at step {step} with margin {top[0] - top[1]}"
    assert len(ours.token_ids) == len(ref.token_ids)


def check_case(engines: Engines, fmt: str, case: Case) -> None:
    llm = engines.get(fmt, case.budget)
    vocab = llm.engine.config.model_config.vocab_size
    for prompt, params, output in run_case(llm, case, vocab):
        assert output.finished and output.outputs[0].finish_reason == "length"
        assert len(output.outputs[0].token_ids) == params.max_tokens
        assert_same_up_to_near_tie(fmt, output, engines.alone(fmt, prompt, params))
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize("fmt", FORMATS)
@EXAMPLES
@given(case=cases())
def test_chunked_prefill_gives_each_request_its_tokens_alone(engines, fmt, case):
    check_case(engines, fmt, case)


@pytest.mark.slow
@settings(EXAMPLES, max_examples=4)
@given(case=cases(max_prompt=96, budgets=(16, 32)))
def test_smollm2_chunked_prefill_gives_each_request_its_tokens_alone(engines, case):
    check_case(engines, SMOLLM2, case)


def logit_shapes(llm: LLM, monkeypatch) -> list[tuple[int, ...]]:
    """The shape of every step's logits, as the runner returns them (filled as the engine steps)."""
    runner, shapes = llm.engine.core.runner, []
    execute = runner.execute

    def recording(batch):
        output = execute(batch)
        shapes.append(tuple(output.logits.shape))
        return output

    monkeypatch.setattr(runner, "execute", recording)
    return shapes


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_prompt_past_the_default_budget_completes_alone(engines, fmt, monkeypatch):
    """A long prompt's edge case: 2,049 tokens at the default max_num_batched_tokens (2,048), alone. Its first step
    is one chunk ending no prompt: logits of no row."""
    llm = engines.get(fmt, STEP_TOKENS)
    assert llm.engine.config.max_num_batched_tokens == 2048
    shapes = logit_shapes(llm, monkeypatch)
    prompt = random.Random(42).choices(range(3, 320), k=2049)
    output = llm.generate([{"prompt_token_ids": prompt}], greedy(2), use_tqdm=False)[0]
    assert shapes == [(0, 320), (1, 320), (1, 320)]
    assert_same_up_to_near_tie(fmt, output, engines.alone(fmt, prompt, greedy(2)))


@pytest.mark.slow
def test_smollm2_answers_a_prompt_past_the_default_budget_alone(engines, monkeypatch):
    """The report itself: SmolLM2 Q4_1 at the default budget, 2,049 random tokens alone, max_tokens 2."""
    llm = engines.get(SMOLLM2, STEP_TOKENS, blocks=136)
    shapes = logit_shapes(llm, monkeypatch)
    prompt = random.Random(42).choices(range(100, 40000), k=2049)
    output = llm.generate([{"prompt_token_ids": prompt}], greedy(2), use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 2
    assert shapes == [(0, 49152), (1, 49152), (1, 49152)]
