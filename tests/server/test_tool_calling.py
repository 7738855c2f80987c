"""Tool calling end to end with the official openai client, on tiny random Qwen 2 / Qwen 3 / Llama
checkpoints carrying their families' real chat templates. "required" and named tools are enforced by
structured outputs, so even random weights must call a tool with arguments valid for its schema
(checked with jsonschema); "auto" replies are read by the template's parser."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import openai
import pytest
import transformers

from llmpipe import LLM
from tests.server.utils import TINY_MODEL, live_server
from tests.server.tool_fixtures import (
    BOUNDED_TOOLS, LLAMA31, MISTRAL_NEMO, QWEN3, QWEN25, WEATHER, as_transformers_takes_it, call, checkpoint_with_template,
    history, reassemble_stream,
)

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in BOUNDED_TOOLS}
NAMED = {"type": "function", "function": {"name": "get_time"}}
# Random weights would go on adding calls to a "required" array until max_tokens: one call, then.
ONE = {"parallel_tool_calls": False}
OPTIONS = dict(model=TINY_MODEL, temperature=0.0, max_tokens=160)
# What a model taught each format writes: the server must read it as a call ("auto").
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'
LLAMA_CALL = r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)", "precise": (true|false)\}\}'


def serve(tmp_path_factory, arch: str, template_name: str):
    path = checkpoint_with_template(tmp_path_factory.mktemp(f"tools_{arch}"), arch, template_name)
    llm = LLM(str(path), progress=False)
    return path, live_server(llm)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path, server = serve(tmp_path_factory, "qwen2", QWEN25)
    with server as url:
        yield path, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120), url


def assert_valid_calls(calls, names=tuple(SCHEMAS)) -> None:
    """`calls` (the openai client's) name the tools in `names`, with arguments valid for their schemas."""
    assert calls
    for tool_call in calls:
        assert tool_call.function.name in names
        jsonschema_rs.validate(SCHEMAS[tool_call.function.name], json.loads(tool_call.function.arguments))


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_required_and_named_tools_are_called_with_valid_arguments(qwen, choice):
    _, client, _ = qwen
    out = client.chat.completions.create(messages=ASK, tools=BOUNDED_TOOLS, tool_choice=choice, **ONE, **OPTIONS)
    message = out.choices[0].message
    assert message.content is None and out.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(message.tool_calls, ["get_time"] if choice == NAMED else SCHEMAS)
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    if choice == NAMED:
        assert len(message.tool_calls) == 1


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(qwen, choice):
    _, client, _ = qwen
    whole = client.chat.completions.create(messages=ASK, tools=BOUNDED_TOOLS, tool_choice=choice, **ONE, **OPTIONS)
    stream = client.chat.completions.create(
        messages=ASK, tools=BOUNDED_TOOLS, tool_choice=choice, stream=True, **ONE, **OPTIONS
    )
    content, calls, finish_reason = reassemble_stream(stream)
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert (content, finish_reason) == (None, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == expected


@pytest.mark.parametrize("parallel", [True, False])
def test_several_calls_in_one_reply_unless_parallel_tool_calls_is_false(qwen, parallel):
    _, client, _ = qwen
    two_calls = HERMES_CALL + r"\n" + HERMES_CALL
    out = client.chat.completions.create(
        messages=ASK, tools=BOUNDED_TOOLS, parallel_tool_calls=parallel,
        extra_body={"structured_outputs": {"regex": two_calls}}, **{**OPTIONS, "max_tokens": 400},
    )
    calls = out.choices[0].message.tool_calls
    assert len(calls) == (2 if parallel else 1) and len({c.id for c in calls}) == len(calls)
    assert_valid_calls(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_hermes_call(qwen, stream):
    """The reply is held to what Qwen writes (a regex), so the Hermes parser must find the call in it."""
    _, client, _ = qwen
    out = client.chat.completions.create(
        messages=ASK, tools=BOUNDED_TOOLS, stream=stream, extra_body={"structured_outputs": {"regex": HERMES_CALL}},
        **OPTIONS,
    )
    if stream:
        content, calls, finish_reason = reassemble_stream(out)
    else:
        message = out.choices[0].message
        content, finish_reason = message.content, out.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert (content, finish_reason) == (None, "tool_calls")
    assert [c["name"] for c in calls] == ["get_weather"] and calls[0]["id"].startswith("call_")
    jsonschema_rs.validate(SCHEMAS["get_weather"], json.loads(calls[0]["arguments"]))


def test_auto_without_a_call_is_the_plain_completion_of_the_same_prompt(qwen):
    """/tokenize renders the tools like the chat route; the completion of those ids is the chat content."""
    _, client, url = qwen
    ids = httpx.post(f"{url}/tokenize", json={"messages": ASK, "tools": BOUNDED_TOOLS}).json()["tokens"]
    chat = client.chat.completions.create(messages=ASK, tools=BOUNDED_TOOLS, **{**OPTIONS, "max_tokens": 12})
    plain = client.completions.create(model=TINY_MODEL, prompt=ids, temperature=0.0, max_tokens=12)
    assert chat.choices[0].message.tool_calls is None
    assert chat.choices[0].message.content == plain.choices[0].text


def test_a_history_of_calls_and_results_is_templated_like_transformers(qwen):
    path, client, url = qwen
    messages = history([call("call_1", "get_weather", {"city": "Paris", "unit": "celsius"})])
    expected = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        as_transformers_takes_it(messages), tools=BOUNDED_TOOLS, add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )
    tokenized = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": BOUNDED_TOOLS}).json()
    assert tokenized["tokens"] == expected
    out = client.chat.completions.create(messages=messages, tools=BOUNDED_TOOLS, tool_choice="required", **ONE, **OPTIONS)
    assert out.usage.prompt_tokens == len(expected)
    assert_valid_calls(out.choices[0].message.tool_calls)


@pytest.mark.parametrize("body,param", [
    ({"tools": BOUNDED_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": BOUNDED_TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": BOUNDED_TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_inconsistent_tool_requests_are_400s_naming_the_field(qwen, body, param):
    _, client, _ = qwen
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=ASK, **OPTIONS, extra_body=body)
    assert err.value.body["param"] == param, err.value.body


def test_auto_on_a_template_without_a_call_format_says_so(tiny_url):
    client = openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as err:
        client.chat.completions.create(messages=ASK, tools=BOUNDED_TOOLS, **OPTIONS)
    assert err.value.body["param"] == "tools"


def test_hermes_tools_reach_a_template_that_renders_none(tiny_path):
    """--tool-call-parser hermes on the tiny model's ChatML template (as SmolLM2's, it renders no tools):
    the tools and a history's calls are in the prompt, not silently dropped."""
    calls = [{"role": "assistant", "content": None, "tool_calls": [call("call_1", "get_time", {"zone": "UTC", "precise": True})]},
             {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    with live_server(LLM(tiny_path, progress=False), tool_call_parser="hermes") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        usage = lambda **extra: client.chat.completions.create(messages=ASK, **{**OPTIONS, "max_tokens": 2}, **extra).usage  # noqa: E731
        assert usage(tools=BOUNDED_TOOLS, tool_choice="auto").prompt_tokens > usage().prompt_tokens
        tokens = httpx.post(f"{url}/tokenize", json={"messages": [*ASK, *calls], "return_token_strs": True}).json()
    assert '"get_time"' in "".join(tokens["token_strs"]).replace("Ġ", " ")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    _, server = serve(tmp_path_factory, "llama_gqa", LLAMA31)
    with server as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def test_llama3_json_calls_are_read_and_required_is_enforced(llama):
    auto = llama.chat.completions.create(
        messages=ASK, tools=BOUNDED_TOOLS, extra_body={"structured_outputs": {"regex": LLAMA_CALL}}, **OPTIONS
    )
    assert [c.function.name for c in auto.choices[0].message.tool_calls] == ["get_time"]
    assert_valid_calls(auto.choices[0].message.tool_calls)
    required = llama.chat.completions.create(messages=ASK, tools=BOUNDED_TOOLS, tool_choice="required", **ONE, **OPTIONS)
    assert_valid_calls(required.choices[0].message.tool_calls)


def test_qwen3_required(tmp_path_factory):
    _, server = serve(tmp_path_factory, "qwen3", QWEN3)
    with server as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        out = client.chat.completions.create(messages=ASK, tools=BOUNDED_TOOLS, tool_choice=NAMED, **OPTIONS)
    assert_valid_calls(out.choices[0].message.tool_calls, ["get_time"])


def test_serve_takes_a_tool_call_parser_by_name(capsys):
    from llmpipe.cli import build_parser

    parsed = build_parser().parse_args(["serve", "--model", "m", "--tool-call-parser", "llama3_json"])
    assert parsed.tool_call_parser == "llama3_json"
    assert build_parser().parse_args(["serve", "--model", "m"]).tool_call_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--tool-call-parser", "nope"])
    assert "hermes" in capsys.readouterr().err


def test_the_configured_parser_wins_over_the_template(tmp_path_factory):
    """--tool-call-parser llama3_json on a Qwen template: a Llama-style reply is read as a call."""
    path = checkpoint_with_template(tmp_path_factory.mktemp("tools_configured"), "qwen2", QWEN25)
    with live_server(LLM(str(path), progress=False), tool_call_parser="llama3_json") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        out = client.chat.completions.create(
            messages=ASK, tools=BOUNDED_TOOLS, extra_body={"structured_outputs": {"regex": LLAMA_CALL}}, **OPTIONS
        )
    assert_valid_calls(out.choices[0].message.tool_calls, ["get_time"])


MISTRAL_CALL = r'\[TOOL_CALLS\]\[\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)", "precise": (true|false)\}\}\]'


def test_mistral_calls_get_ids_its_template_takes_back(tmp_path_factory):
    """Mistral Nemo's template refuses call ids that are not 9 alphanumerics: the ids the server gives
    must survive the round trip of a call and its result back into the conversation."""
    _, server = serve(tmp_path_factory, "mistral", MISTRAL_NEMO)
    with server as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        out = client.chat.completions.create(
            messages=ASK, tools=BOUNDED_TOOLS, extra_body={"structured_outputs": {"regex": MISTRAL_CALL}}, **OPTIONS
        )
        [tool_call] = out.choices[0].message.tool_calls
        assert_valid_calls([tool_call], ["get_time"])
        assert len(tool_call.id) == 9 and tool_call.id.isalnum()
        follow_up = [*ASK, {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},
                     {"role": "tool", "tool_call_id": tool_call.id, "content": "12:00"}]
        again = client.chat.completions.create(messages=follow_up, tools=BOUNDED_TOOLS, **{**OPTIONS, "max_tokens": 4})
    assert again.choices[0].finish_reason in ("length", "stop")
