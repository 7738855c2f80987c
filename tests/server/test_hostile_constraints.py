"""Hostile and impossible constraints against a live `llmpipe serve`: each is answered
with a 4xx (or a 200 where it is sound), never a 5xx, while a concurrent stream runs to its end and
the server keeps serving. Before the sandbox, the first of these killed the server process
(a native stack overflow while compiling) and every in-flight request with it.

And a fuzz test (hypothesis): random schemas with $ref cycles and depth, grammars with chains and
alternations of random size, never get a 5xx nor take the server down."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.test_shutdown import PACED_SERVE, stream
from tests.server.utils import free_port, wait_for_serve
from tests.structured_output import hostile

STREAM_TOKENS = 120  # paced at 50 ms a step: the stream outlasts the hostile requests on any machine
CHAT = [{"role": "user", "content": "x"}]


def chat_schema(schema: dict) -> dict:
    return {"messages": CHAT, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def named_tool(schema: dict, **extra) -> dict:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return {"messages": CHAT, "max_tokens": 4, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "f"}}, **extra}


def responses_schema(schema: dict) -> dict:
    return {"input": "x", "max_output_tokens": 4, "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}


# (route, body, expected status): the probe's crashing inputs, then the wrong answers it found.
CASES = {
    "ref chain 3000": ("/v1/chat/completions", chat_schema(hostile.ref_chain()), 400),
    "objects nested 1000": ("/v1/chat/completions", chat_schema(hostile.nested_objects()), 400),
    "lark chain 3000": ("/v1/completions", {"prompt": "x", "max_tokens": 4,
                                            "structured_outputs": {"grammar": hostile.lark_chain()}}, 200),
    "gbnf chain 5000": ("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_grammar": hostile.gbnf_chain()}, 400),
    "responses ref chain": ("/v1/responses", responses_schema(hostile.ref_chain()), 400),
    "gbnf 100,000 alternatives": ("/v1/completions", {"prompt": "x", "max_tokens": 4,
                                                      "guided_grammar": hostile.gbnf_alternatives()}, 400),
    "schema $ref to itself": ("/v1/chat/completions", chat_schema(hostile.SELF_REFERENCE), 400),
    "definition $ref to itself": ("/v1/chat/completions", chat_schema(hostile.SELF_DEFINITION), 400),
    "named tool $ref to itself": ("/v1/chat/completions", named_tool(hostile.SELF_REFERENCE), 400),
    "responses $ref to itself": ("/v1/responses", responses_schema(hostile.SELF_REFERENCE), 400),
    "grammar never ends": ("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_grammar": hostile.NEVER_ENDS}, 400),
    "choice shorter than min_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": 60, "min_tokens": 50,
                                                           "structured_outputs": {"choice": ["yes", "no"]}}, 400),
    "grammar ends before min_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": 60, "min_tokens": 50,
                                                           "structured_outputs": {"regex": "ab"}}, 200),
}


@pytest.fixture(scope="module")
def server(tiny_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-c", PACED_SERVE, "serve", "--model", tiny_path, "--port", str(port)],
                               stderr=subprocess.PIPE, text=True)
    try:
        wait_for_serve(process, url)
        yield url, process
    finally:
        process.kill()
        process.wait()


def test_hostile_constraints_are_answered_while_a_stream_runs_to_its_end(server):
    url, process = server
    events: list[str] = []
    started = threading.Event()
    streamer = threading.Thread(target=stream, args=(url, STREAM_TOKENS, started, events))
    streamer.start()
    assert started.wait(120)
    answers = {}
    for name, (route, body, _) in CASES.items():
        response = httpx.post(f"{url}{route}", json=body, timeout=300)
        answers[name] = (response.status_code, response.text[:300])
        assert process.poll() is None, f"{name} took the server down"
    still_streaming = streamer.is_alive()
    streamer.join(timeout=300)
    assert {name: status for name, (status, _) in answers.items()} == {name: c[2] for name, c in CASES.items()}, answers
    assert still_streaming, "the stream ended before the hostile requests did: the test proved nothing"
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])["choices"][0]
    assert last["finish_reason"] == "length"
    assert httpx.get(f"{url}/health").status_code == 200


def test_the_grammar_end_before_min_tokens_is_said(server):
    url, _ = server
    route, body, _ = CASES["grammar ends before min_tokens"]
    choice = httpx.post(f"{url}{route}", json=body, timeout=300).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("ab", "stop", "grammar_end")


# ---- fuzz ----------------------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "d"])
LEAVES = st.sampled_from([{"type": "integer"}, {"type": "string", "maxLength": 3}, {"type": "boolean"},
                          {"enum": ["x", "y"]}, {"$ref": "#"}, {"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"},
                          {"type": "integer", "minimum": 3, "maximum": 1}])


def _objects(children):
    return st.one_of(
        st.builds(lambda props, req: {"type": "object", "properties": props, "required": sorted(set(req) & set(props))},
                  st.dictionaries(NAMES, children, max_size=3), st.lists(NAMES, max_size=3)),
        st.builds(lambda items, n: {"type": "array", "items": items, "minItems": n}, children, st.integers(0, 2)),
        st.builds(lambda options: {"anyOf": options}, st.lists(children, min_size=1, max_size=3)),
    )


SCHEMAS = st.builds(
    lambda root, defs, chain: {**root, "$defs": {**defs, **{f"c{i}": {"$ref": f"#/$defs/c{i + 1}"} for i in range(chain)},
                                                 f"c{chain}": {"$ref": "#/$defs/a"}}},
    _objects(st.recursive(LEAVES, _objects, max_leaves=8)),
    st.fixed_dictionaries({"a": st.recursive(LEAVES, _objects, max_leaves=4), "b": LEAVES}),
    st.sampled_from([0, 3, 200, 4000]),
)


def _grammar(chain: int, alternatives: int, recursive: bool) -> str:
    rules = ["root ::= r0"] + [f"r{i} ::= r{i + 1}" for i in range(chain)]
    body = " | ".join(f'"w{i}"' for i in range(alternatives))
    rules.append(f"r{chain} ::= " + (f'"(" r{chain} ")" | {body}' if recursive else body))
    return "\n".join(rules) + "\n"


GRAMMARS = st.builds(_grammar, st.sampled_from([0, 10, 2000, 6000]), st.sampled_from([1, 50, 3000, 70_000]),
                     st.booleans()) | st.builds(lambda n: f'root ::= {"(" * n}"a"{")" * n}\n', st.sampled_from([1, 500, 20_000]))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(constraint=st.one_of(SCHEMAS.map(lambda s: {"structured_outputs": {"json": s}}),
                            GRAMMARS.map(lambda g: {"guided_grammar": g})))
def test_fuzzed_constraints_never_get_a_5xx(server, constraint):
    url, process = server
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3, **constraint}, timeout=300)
    assert response.status_code in (200, 400), response.text[:500]
    if response.status_code == 200:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert process.poll() is None
