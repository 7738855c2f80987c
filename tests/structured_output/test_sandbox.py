"""The grammar sandbox: untrusted constraints are bounded, then compiled in a worker process whose
crash or overrun is a verdict for that constraint alone. The hostile inputs crashed the
process that compiled them (a native stack overflow) before."""

from __future__ import annotations

import json

import pytest

from llmpipe.errors import InvalidRequestError
from llmpipe.sampling_params import StructuredOutputsParams
from llmpipe.structured_output import check_structured_outputs
from llmpipe.structured_output.grammar import MAX_SCHEMA_DEPTH, grammar_key, schema_depth
from llmpipe.structured_output.sandbox import GrammarSandbox
from tests.structured_output import hostile

OK_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def sandbox():
    box = GrammarSandbox(timeout_s=120)  # a hang guard: these compile in well under a second
    yield box
    box.close()


def key(**spec) -> tuple:
    return grammar_key(StructuredOutputsParams(**spec))


@pytest.mark.parametrize("spec,problem", [
    ({"json": hostile.ref_chain()}, "nested more than"),
    ({"json": hostile.nested_objects()}, "nested more than"),
    ({"grammar": hostile.gbnf_chain()}, "rules, over the limit"),
    ({"grammar": hostile.gbnf_alternatives()}, "characters, over the limit"),
    ({"json": hostile.SELF_REFERENCE}, "matches no text"),
    ({"json": hostile.SELF_DEFINITION}, "matches no text"),
    ({"grammar": hostile.NEVER_ENDS}, "can never end"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum"),
])
def test_hostile_and_impossible_constraints_get_a_verdict(sandbox, spec, problem):
    verdict = sandbox.check(key(**spec))
    assert verdict.problem is not None and problem in verdict.problem, verdict


@pytest.mark.parametrize("spec", [{"json": OK_SCHEMA}, {"regex": "[a-z]{3}"}, {"choice": ["yes", "no"]},
                                  {"grammar": hostile.lark_chain()},  # deep, under the bounds: it compiles
                                  {"json": {"type": "object", "properties": {"next": {"$ref": "#"}}}}])
def test_sound_constraints_pass(sandbox, spec):
    assert sandbox.check(key(**spec)).problem is None


def test_a_gbnf_grammar_comes_back_as_lark_the_core_need_not_convert():
    spec = check_structured_outputs(StructuredOutputsParams(grammar='root ::= "a" [b-c]*'))
    assert "::=" not in spec.grammar and "start:" in spec.grammar


def test_a_crash_in_the_compiler_fails_that_constraint_alone():
    """On the default 8 MiB thread stack, compiling a 3,000-rule chain overflows llguidance's stack
    (SIGSEGV): the worker dies, that constraint is refused, the next check gets a new worker."""
    box = GrammarSandbox(workers=1, timeout_s=120, stack_bytes=8 * 2**20)
    try:
        crashed = box.check(key(grammar=hostile.lark_chain()))
        assert "crashed" in crashed.problem, crashed
        assert box.check(key(json=OK_SCHEMA)).problem is None
    finally:
        box.close()


def test_a_compile_past_the_deadline_is_answered_and_the_worker_replaced():
    box = GrammarSandbox(workers=1, timeout_s=1e-3)  # no worker starts, let alone compiles, in 1 ms
    try:
        late = box.check(key(grammar=hostile.gbnf_chain(2000)))
        assert "did not compile within" in late.problem, late
        box.timeout_s = 120
        assert box.check(key(grammar=hostile.gbnf_chain(2000))).problem is None  # a timeout is not cached
    finally:
        box.close()


def test_the_check_names_the_field():
    with pytest.raises(InvalidRequestError) as err:
        check_structured_outputs(StructuredOutputsParams(json=hostile.SELF_REFERENCE), "response_format")
    assert err.value.param == "response_format" and "matches no text" in str(err.value)


@pytest.mark.parametrize("schema,depth", [
    ({}, 1),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, 3),
    ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"}, 3),
    ({"properties": {"a": {"$ref": "#"}}}, 3),  # recursion adds nothing
    ({"items": [[[[{}]]]]}, 6),  # every container counts
    ([], 1),
])
def test_schema_depth_counts_through_refs(schema, depth):
    assert schema_depth(schema, MAX_SCHEMA_DEPTH) == depth


def test_schema_depth_stops_counting_past_the_limit():
    deep: dict = {}
    for _ in range(10_000):  # deeper than Python's recursion limit
        deep = {"not": deep}
    assert schema_depth(json.loads(json.dumps(hostile.ref_chain())), 50) > 50
    assert schema_depth(deep, 50) > 50
