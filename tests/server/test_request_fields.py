"""Every request field OpenAI or vLLM defines is honoured or refused with a 400 naming it; nothing
accepted is silently ignored, types are strict, text is valid Unicode, and lists have caps."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from llmpipe.server.pooling_protocol import POOLING_REQUESTS
from llmpipe.server.protocol import MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_STRINGS, REQUESTS, field_table
from tests.server.utils import TINY_MODEL, live_server

KEY = "sk-fields"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "hi"}]
BASE = {
    "/v1/completions": {"prompt": [1, 5, 9], "max_tokens": 3},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 3},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [5, 6]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 3},
}
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


class Fields(dict):
    """An example that needs other fields set with it (None: leave the base request's field out)."""


SAMPLING_EXAMPLES = {
    "model": TINY_MODEL,
    "temperature": 0.5,
    "top_p": 0.9,
    "n": 2,
    "stop": ["zz"],
    "seed": 7,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "logit_bias": {"5": 2.0},
    "stream": True,
    "stream_options": Fields(stream=True, stream_options={"include_usage": True}),
    "user": "user-1",
    "safety_identifier": "user-1",
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "min_tokens": 2,
    "ignore_eos": True,
    "stop_token_ids": [7],
    "skip_special_tokens": False,
    "include_stop_str_in_output": True,
    "return_tokens_as_token_ids": True,
    "truncate_prompt_tokens": 2,
    "response_format": {"type": "json_object"},
    "structured_outputs": {"choice": ["yes", "no"]},
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]{1,3}",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "yes" | "no"',
    "cache_salt": "tenant-1",
}
# route → field → the extra body fields of a request that uses it (and must get a 200)
SUPPORTED_EXAMPLES = {
    "/v1/completions": {
        **SAMPLING_EXAMPLES,
        "prompt": "hello there",
        "max_tokens": 2,
        "logprobs": 2,
        "echo": True,
        "prompt_logprobs": 1,
        "add_special_tokens": False,
    },
    "/v1/chat/completions": {
        **SAMPLING_EXAMPLES,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 2,
        "max_completion_tokens": Fields(max_completion_tokens=2, max_tokens=None),
        "logprobs": True,
        "top_logprobs": Fields(logprobs=True, top_logprobs=2),
        "add_generation_prompt": False,
        "add_special_tokens": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": Fields(tools=WEATHER_TOOLS, tool_choice="none"),
        "tool_choice": Fields(tools=WEATHER_TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        "parallel_tool_calls": Fields(tools=WEATHER_TOOLS, tool_choice="required", parallel_tool_calls=False),
        "prompt_logprobs": Fields(prompt_logprobs=1, stream=None),
    },
    "/tokenize": {
        "model": TINY_MODEL,
        "prompt": "hello",
        "messages": Fields(prompt=None, messages=CHAT),
        "add_special_tokens": False,
        "add_generation_prompt": Fields(prompt=None, messages=CHAT, add_generation_prompt=False),
        "chat_template_kwargs": Fields(prompt=None, messages=CHAT, chat_template_kwargs={"x": 1}),
        "return_token_strs": True,
        "tools": Fields(prompt=None, messages=CHAT, tools=WEATHER_TOOLS),
    },
    "/detokenize": {"model": TINY_MODEL, "tokens": [5, 6, 7]},
    "/v1/responses": {
        "model": TINY_MODEL,
        "input": [{"role": "user", "content": "hi"}],
        "instructions": "be brief",
        "max_output_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "top_logprobs": 2,
        "include": ["message.output_text.logprobs"],
        "stream": True,
        "stream_options": Fields(stream=True, stream_options={}),
        "tools": Fields(tools=RESPONSES_TOOLS, tool_choice="none"),
        "tool_choice": Fields(tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "get_weather"}),
        "parallel_tool_calls": Fields(tools=RESPONSES_TOOLS, tool_choice="required", parallel_tool_calls=False),
        "text": {"format": {"type": "json_object"}},
        "metadata": {"topic": "greeting"},
        "user": "user-1",
        "safety_identifier": "user-1",
    },
}


def asking_value(off: tuple):
    """A value that asks for something: not one of the field's `off` values."""
    return next(v for v in (True, "x", 3, {"type": "json_object"}, [1]) if not any(v == o for o in off))


@pytest.fixture(scope="module")
def url(tiny_llm):
    with live_server(tiny_llm, api_key=KEY) as url:
        yield url


def post(url: str, route: str, body: dict) -> httpx.Response:
    content = json.dumps(body).encode()  # ASCII escapes, so lone surrogates travel as JSON has them
    return httpx.post(f"{url}{route}", content=content, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)


def assert_refused(response: httpx.Response, param: str, code: str | None = None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize("route", REQUESTS)
def test_every_field_of_every_route_is_either_supported_or_refused(route):
    fields = set(REQUESTS[route].model_fields)
    supported, refused = set(SUPPORTED_EXAMPLES[route]), set(REQUESTS[route].REFUSED)
    assert not supported & refused
    assert fields == supported | refused, f"neither handled nor refused: {fields - supported - refused}"


@pytest.mark.parametrize("route,field", [(r, f) for r in REQUESTS for f in SUPPORTED_EXAMPLES[r]])
def test_a_supported_field_is_accepted(url, route, field):
    example = SUPPORTED_EXAMPLES[route][field]
    extra = example if isinstance(example, Fields) else {field: example}
    body = {k: v for k, v in {**BASE[route], **extra}.items() if v is not None}
    response = post(url, route, body)
    assert response.status_code == 200, response.text
    assert '"error":{' not in response.text[:200].replace(" ", "")  # no error body, nor a stream's error event


@pytest.mark.parametrize("route,field", [(r, f) for r, model in REQUESTS.items() for f in model.REFUSED])
def test_a_refused_field_asking_for_something_is_a_400_naming_it(url, route, field):
    off = REQUESTS[route].REFUSED[field].off
    body = {**BASE[route], field: asking_value(off)}
    if field == "best_of":
        body["best_of"] = 3
    assert_refused(post(url, route, body), field, "unsupported_parameter")
    for value in off:  # what asks for nothing is accepted
        if value is not None:
            assert post(url, route, {**BASE[route], field: value}).status_code == 200


def test_the_serving_docs_list_every_field_as_the_server_treats_it():
    readme = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    for route, field, what in field_table(REQUESTS | POOLING_REQUESTS):
        assert f"| `{route}` | `{field}` | {what} |" in readme, (route, field)


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5.0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "seed": "42"}, "seed"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "surprise": 1}, "surprise"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages[0].colour"),
    ],
)
def test_loose_types_and_unknown_fields_are_refused_as_openai_does(url, route, body, param):
    error = assert_refused(post(url, route, body), param)
    assert error["code"] in ("invalid_type", "unknown_parameter")
    for leak in (".str", "list[", "TextPart", "function-after"):
        assert leak not in error["message"] and leak not in error["param"]


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/completions", {"prompt": "hi \udfff"}, "prompt"),
        ("/v1/completions", {"prompt": ["hi \ud800"]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": ["\udfff"]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \udfff"}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
         "messages[0].content"),
        ("/tokenize", {"prompt": "hi \udfff"}, "prompt"),
    ],
)
def test_unpaired_surrogates_are_a_400_naming_the_field(url, route, body, param):
    error = assert_refused(post(url, route, body), param)
    assert "surrogate" in error["message"]


def test_union_errors_say_what_the_field_accepts_without_pydantic_names(url):
    error = assert_refused(post(url, "/v1/completions", {"prompt": 5}), "prompt")
    assert "a string, a list of token ids" in error["message"]
    error = assert_refused(post(url, "/v1/completions", {"prompt": [1, -4]}), "prompt")
    assert "[1]" in error["message"] and "greater than or equal to 0" in error["message"]
    error = assert_refused(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}),
                           "messages[0].content")
    assert "a string or a list of text parts" in error["message"]


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/completions", {"prompt": "x", "stop": ["s" * 100] * 70_000}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": "s" * (MAX_STOP_CHARS + 1)}, "stop"),
        ("/v1/chat/completions", {"messages": CHAT * (MAX_MESSAGES + 1)}, "messages"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1.0}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 1, "stop_token_ids": [10**9]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [-(10**9)]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "to be " * 2**20}, "prompt"),  # refused before it is tokenized
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "to be " * 2**20}]}, "messages"),
    ],
)
def test_limits_and_relations_between_fields_are_a_400_naming_the_field(url, route, body, param):
    assert_refused(post(url, route, body), param)


def test_logit_bias_steers_greedy_decoding(url):
    body = {"prompt": [1, 5, 9], "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "logit_bias": {"42": 100}}
    choice = post(url, "/v1/completions", {**body, "return_tokens_as_token_ids": True, "logprobs": 0}).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == ["token_id:42"] * 5


def test_truncate_prompt_tokens_keeps_the_last_tokens(url):
    body = {"prompt": list(range(3, 303)) * 5, "max_tokens": 2, "truncate_prompt_tokens": 10}
    assert post(url, "/v1/completions", body).json()["usage"]["prompt_tokens"] == 10


def test_best_of_equal_to_n_asks_for_nothing_more(url):
    assert post(url, "/v1/completions", {**BASE["/v1/completions"], "n": 2, "best_of": 2}).status_code == 200


def test_the_api_description_needs_the_key(url):
    for path in ("/openapi.json", "/docs"):
        assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.get(f"{url}{path}", headers=AUTH).status_code == 200
    schemas = httpx.get(f"{url}/openapi.json", headers=AUTH).json()["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "ChatMessage"} <= set(schemas)


def test_a_long_tokenize_reply_equals_the_tokenizer_output(url, tiny_llm):
    """Rendered in slices (it holds millions of ids): the same JSON a one-shot render would give."""
    text = "the quick brown fox jumps over the lazy dog. " * 20_000
    reply = post(url, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    tokenizer = tiny_llm.get_tokenizer()
    expected = tokenizer.backend.encode(text).ids  # the library's own output
    assert reply["tokens"] == expected and reply["count"] == len(expected) > 65_536
    assert reply["token_strs"] == [tokenizer.backend.id_to_token(t) for t in expected]


def test_a_history_tool_call_may_carry_its_stream_index_which_the_template_never_sees():
    from llmpipe.server.protocol import ChatMessage

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    message = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]})
    message.check_supported()
    assert message.as_template_input()["tool_calls"] == [{k: v for k, v in call.items() if k != "index"}]
