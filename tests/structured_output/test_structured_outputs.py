"""Structured outputs in the engine: sampled outputs of a random-weight model (no idea of JSON) are
checked against references (jsonschema, re.fullmatch, membership), never against earlier output."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import Future

import jsonschema
import msgspec
import numpy as np
import pytest
import torch

from llmpipe import LLM
from llmpipe.engine.core_messages import EngineCoreRequest
from llmpipe.errors import InvalidRequestError
from llmpipe.sampling_params import SamplingParams, StructuredOutputsParams
from llmpipe.structured_output.bitmask import allowed_tokens, any_token_left

# Nested objects, an enum, an array, required keys, integers; strings and arrays bounded, so a model
# that never chooses to close one is closed by the grammar.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
PROMPTS = ["a person:", "some JSON", "write it", "the record", "fill in"]
MAX_TOKENS = 400  # past the longest compact output these bounds allow


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint("llama_gqa")), progress=False)


@pytest.fixture(scope="module")
def spec_llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint("llama_gqa")), progress=False, speculative_method="ngram", prompt_lookup_min=1,
               num_speculative_tokens=3)


def constrained(seed: int = 0, n: int = 1, temperature: float = 1.0, max_tokens: int = MAX_TOKENS, min_tokens: int = 0,
                **spec) -> SamplingParams:
    return SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=max_tokens, min_tokens=min_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def generate_each(llm: LLM, requests: list[tuple[str, SamplingParams]]):
    """Requests with params of their own, batched together (LLM.generate gives all prompts one)."""
    for i, (prompt, params) in enumerate(requests):
        llm.engine.add_request(f"each-{i}", prompt, params)
    finished = {}
    while llm.engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in llm.engine.step() if out.finished)
    return [finished[f"each-{i}"] for i in range(len(requests))]


def texts(outputs) -> list[str]:
    finished = [c for out in outputs for c in out.outputs]
    assert all(c.finish_reason == "stop" for c in finished), [(c.finish_reason, c.error, c.text) for c in finished]
    return [c.text for c in finished]


def test_fifty_samples_at_temperature_one_validate_against_the_schema(llm):
    # Flexible whitespace between tokens (the default, bounded as llama.cpp bounds it) and compact.
    flexible = constrained(n=1, json=SCHEMA)
    compact = constrained(n=9, seed=1, json=SCHEMA, disable_any_whitespace=True)
    samples = texts(generate_each(llm, [(p, flexible) for p in PROMPTS] + [(p, compact) for p in PROMPTS]))
    assert len(samples) == 50
    for text in samples:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(samples)) == 50  # n > 1: each sample its own matcher, drawn on its own
    outside_strings = [re.sub(r'"(?:[^"\\]|\\.)*"', '""', text) for text in samples]
    for text in outside_strings[:5]:  # flexible: one space, or a newline and at most 20 of indent
        assert all(re.fullmatch(r" |\n[ \t]{0,20}", run) for run in re.findall(r"\s+", text)), text
    assert any(re.search(r"\s", text) for text in outside_strings[:5])  # the random model does use it
    for text in outside_strings[5:]:  # compact: no whitespace outside strings
        assert not re.search(r"\s", text), text


def test_json_object_is_any_json_object(llm):
    """Nothing bounds an arbitrary object's strings, so some samples may run to max_tokens."""
    outputs = llm.generate(PROMPTS[:2], constrained(n=4, json_object=True, max_tokens=150), use_tqdm=False)
    finished = [c.text for out in outputs for c in out.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 3
    for text in finished:
        assert isinstance(json.loads(text), dict)


def test_regex_and_choice_outputs_match(llm):
    pattern = r"[a-z]{2,6}-[0-9]{2}"
    for text in texts(llm.generate(PROMPTS, constrained(n=4, regex=pattern), use_tqdm=False)):
        assert re.fullmatch(pattern, text), text
    choices = ["yes", "no", "maybe so", "{\"a\": 1}"]
    picked = texts(llm.generate(PROMPTS, constrained(n=4, choice=choices), use_tqdm=False))
    assert set(picked) <= set(choices) and len(set(picked)) > 1


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm):
    params = constrained(n=4, choice=["left", "right"])
    params.ignore_eos = True
    assert set(texts(llm.generate(PROMPTS[:2], params, use_tqdm=False))) <= {"left", "right"}


def test_a_gbnf_grammar_is_followed(llm):
    grammar = 'root ::= num (op num){0,3}\nnum ::= [1-9] [0-9]{0,2}\nop ::= " + " | " * "'
    for text in texts(llm.generate(PROMPTS, constrained(n=4, grammar=grammar), use_tqdm=False)):
        assert re.fullmatch(r"[1-9][0-9]{0,2}(?: [+*] [1-9][0-9]{0,2}){0,3}", text), text


def test_a_lark_grammar_is_followed(llm):
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[a-c]{1,2}/'
    outputs = llm.generate(PROMPTS[:2], constrained(n=4, grammar=grammar, max_tokens=60), use_tqdm=False)
    for choice in (c for out in outputs for c in out.outputs):
        # an unbounded list may run to max_tokens; what there is must be a prefix of the language
        assert re.fullmatch(r"\((?:[a-c]{1,2},)*[a-c]{1,2}\)" if choice.finish_reason == "stop"
                            else r"\((?:[a-c]{1,2},)*[a-c]{0,2}", choice.text), choice.text


def test_unconstrained_requests_in_the_same_batch_are_untouched(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    mixed = generate_each(llm, [(PROMPTS[0], plain), (PROMPTS[1], plain),
                                (PROMPTS[0], constrained(json=SCHEMA, disable_any_whitespace=True)),
                                (PROMPTS[1], constrained(regex="[0-9]{1,8}"))])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]


def test_greedy_constrained_tokens_are_the_masked_argmax(llm):
    """Reference: the model's own logits (scored from scratch) with every token the output's
    grammar forbids removed; the constrained greedy output takes the argmax of what is left."""
    pattern = r"(ab|cd|[0-9]){1,5}"
    out = llm.generate([PROMPTS[0]], constrained(temperature=0.0, regex=pattern), use_tqdm=False)[0]
    ids, prompt = out.outputs[0].token_ids, out.prompt_token_ids
    tokenizer = llm.get_tokenizer()
    logits = llm.engine.score(prompt + ids)[len(prompt) - 1 :]

    def viable(text: str) -> bool:  # a prefix of a string the pattern matches ("a" and "c" need their pair)
        return any(re.fullmatch(pattern, text + end) for end in ("", "b" if text.endswith("a") else "",
                                                                 "d" if text.endswith("c") else ""))

    for step, token in enumerate(ids):
        prefix = tokenizer.decode(ids[:step])
        pieces = [tokenizer.decode([t]) for t in range(logits.shape[-1])]
        candidates = [t for t, piece in enumerate(pieces) if piece and viable(prefix + piece)]
        if step > 0 and re.fullmatch(pattern, prefix):
            candidates += sorted(llm.engine.core.eos_token_ids)
        best = max(candidates, key=lambda t: float(logits[step, t]))
        assert token == best, (step, prefix)


def test_speculative_decoding_keeps_outputs_grammar_valid(spec_llm):
    samples = texts(spec_llm.generate(PROMPTS[:3], constrained(n=2, json=SCHEMA, disable_any_whitespace=True),
                                      use_tqdm=False))
    for text in samples:
        jsonschema.validate(json.loads(text), SCHEMA)
    stats = spec_llm.engine.core.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_speculative_decoding_at_temperature_zero_gives_the_tokens_without_it(llm, spec_llm):
    params = [constrained(temperature=0.0, json=SCHEMA, disable_any_whitespace=True),
              constrained(temperature=0.0, regex=r"(ab|ba|[0-9]){4,30}"),
              constrained(temperature=0.0, grammar='root ::= ("x" | "yz" | " ")+ "."', max_tokens=40)]
    for p in params:
        plain = llm.generate(PROMPTS[:2], p, use_tqdm=False)
        spec = spec_llm.generate(PROMPTS[:2], p, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def test_an_invalid_constraint_is_refused_at_admission_naming_the_field(llm):
    for spec, param in [(dict(regex="[a-z"), "structured_outputs.regex"),
                        (dict(json={"type": "integer", "minimum": 5, "maximum": 2}), "structured_outputs.json"),
                        (dict(json="{not json"), "structured_outputs.json"),
                        (dict(grammar='root ::= ("a" |'), "structured_outputs.grammar")]:
        with pytest.raises(InvalidRequestError) as err:
            llm.generate(["x"], constrained(**spec), use_tqdm=False)
        assert err.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_min_tokens_past_every_choice_is_refused_at_admission(llm):
    """No output of ["yes", "no"] has 50 tokens (each token spells at least one byte): a 400, not a failed step."""
    with pytest.raises(InvalidRequestError, match="min_tokens") as err:
        llm.generate(["x"], constrained(choice=["yes", "no"], min_tokens=50))
    assert err.value.param == "min_tokens"


def test_the_grammars_end_outranks_min_tokens_and_says_so(llm):
    """min_tokens bans EOS, but the grammar allows nothing else: the output ends with the grammar
    (stop_reason "grammar_end"), where it used to fail; the request beside it is untouched."""
    short = constrained(regex="ab", min_tokens=8)
    fine = constrained(choice=["ab", "cd"])
    outputs = generate_each(llm, [("x", short), ("y", fine)])
    ended = outputs[0].outputs[0]
    assert (ended.finish_reason, ended.stop_reason, ended.text) == ("stop", "grammar_end", "ab")
    assert outputs[1].outputs[0].finish_reason == "stop" and outputs[1].outputs[0].text in ("ab", "cd")


def test_a_request_waits_in_the_queue_while_its_grammar_compiles(llm):
    """The step neither blocks on a compile nor fails for one: the request keeps its place until
    its grammar is ready, and the others run meanwhile."""
    core = llm.engine.core
    core.add_request(EngineCoreRequest("slow", [5, 6, 7], constrained(regex="[a-z]{3}")))
    compiled, pending = core.structured._requests["slow"], Future()
    core.structured._requests["slow"] = pending  # a compile still running
    core.add_request(EngineCoreRequest("other", [5, 6, 8], SamplingParams(max_tokens=2, ignore_eos=True)))
    assert {o.request_id for o in core.step().outputs} == {"other"}
    assert [s.request_id for s in core.scheduler.waiting] == ["slow"]
    while "other" in core.requests:
        core.step()
    assert core.step().outputs == [] and core.has_unfinished_requests()  # nothing else to run: it waits
    pending.set_result(compiled.result())
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    assert re.fullmatch("[a-z]{3}", llm.get_tokenizer().decode(tokens))


class DoneAfterFirstLook(Future):
    """A compile that finishes right after the scheduler looked at it (it answers not done once)."""

    looked = False

    def done(self) -> bool:
        looked, self.looked = self.looked, True
        return looked and super().done()


def test_a_compile_finishing_after_the_scheduler_looked_is_no_stall_error(llm):
    """The step trusts what the scheduler saw: a request held for its grammar, its compile done a moment
    later, is a wait — not "the scheduler made no progress" (which failed a server test under load)."""
    core = llm.engine.core
    core.add_request(EngineCoreRequest("racing", [5, 6, 7], constrained(regex="[a-z]{3}")))
    finishing = DoneAfterFirstLook()
    finishing.set_result(core.structured._requests["racing"].result())
    core.structured._requests["racing"] = finishing
    assert core.step().outputs == []
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    assert re.fullmatch("[a-z]{3}", llm.get_tokenizer().decode(tokens))


def test_structured_outputs_survive_the_core_process_boundary():
    params = constrained(n=2, json={"type": "object", "properties": {"a": {"type": "integer"}}},
                         disable_any_whitespace=True)
    request = EngineCoreRequest("r", [1, 2], params)
    wired = msgspec.msgpack.Decoder(EngineCoreRequest).decode(msgspec.msgpack.Encoder().encode(request))
    assert wired.params.structured_outputs == params.structured_outputs


def test_bitmask_unpacking_matches_a_bit_by_bit_reference():
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    allowed = allowed_tokens(list(words), 100, torch.device("cpu"))
    reference = [[bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(100)] for r in range(3)]
    assert allowed.tolist() == reference


def test_any_token_left_ignores_banned_tokens():
    bitmask = np.zeros(4, dtype=np.int32)
    bitmask[1] = 1 << 3  # token 35 alone
    assert any_token_left(bitmask) and any_token_left(bitmask, [7, 100])
    assert not any_token_left(bitmask, [35])
    assert bitmask[1] == 1 << 3  # the caller's mask is left as it was
    top = np.array([np.int32(-(2**31))], dtype=np.int32)  # token 31 alone: the sign bit
    assert any_token_left(top) and not any_token_left(top, [31])


def test_the_core_compiles_on_low_priority_threads_with_a_stack_for_deep_grammars(llm):
    """A 3,000-rule chain overflows llguidance's stack on a default 8 MiB thread (the sandbox's crash
    test shows it): the core's compile threads have room for it, and yield the cores to the step."""
    from llmpipe.structured_output.grammar import COMPILE_NICE, grammar_key
    from tests.structured_output.hostile import lark_chain

    manager = llm.engine.core.structured
    key = grammar_key(StructuredOutputsParams(grammar=lark_chain()))
    assert not manager._compile(key).result(timeout=120).is_error()
    nice = manager._pool_for().submit(os.getpriority, os.PRIO_PROCESS, 0).result(timeout=60)
    assert nice >= COMPILE_NICE
