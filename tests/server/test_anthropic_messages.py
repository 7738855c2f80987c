"""POST /v1/messages and /v1/messages/count_tokens with the official anthropic client: the same
conversation as chat completions (one code path), reshaped into Anthropic's message, stream events and
error bodies; tool_use and tool_result blocks round trip through a Qwen 2.5 template's tool calls."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmpipe import LLM
from llmpipe.server.anthropic import chat_body, error_body, stream_error
from llmpipe.server.anthropic_protocol import MessagesRequest
from tests.server.references import token_ids_of
from tests.server.tool_fixtures import QWEN25, TIME, WEATHER, checkpoint_with_template
from tests.server.utils import TINY_MODEL, live_server

KEY = "sk-local"
SMOLLM2 = "smollm2"
GREEDY = {"temperature": 0.0}  # the anthropic client takes sampling settings as extra_body
SYSTEM = "Be brief."
ASK = [{"role": "user", "content": "Say hello."}]
real_model = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    """The real SmolLM2-135M-Instruct behind a server with an API key (the anthropic client sends x-api-key)."""
    llm = LLM("smollm2-135m-instruct", progress=False)
    with live_server(llm, model_name=SMOLLM2, api_key=KEY) as url:
        yield llm, url


@pytest.fixture(scope="module")
def client(smol) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smol[1], api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(smol):
    """The same request as a greedy chat completion (Authorization: Bearer), with its token ids."""
    openai_client = openai.OpenAI(base_url=f"{smol[1]}/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, *ASK]
    out = openai_client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=60, logprobs=True,
                                                extra_body={"return_tokens_as_token_ids": True}, **GREEDY)
    prompt_ids = smol[0].chat_prompt(messages)["prompt_token_ids"]
    return out, prompt_ids, token_ids_of([item.token for item in out.choices[0].logprobs.content])


def create(client: anthropic.Anthropic, **options):
    options = {"model": SMOLLM2, "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
               "messages": ASK, "max_tokens": 60, "extra_body": GREEDY, **options}
    return client.messages.create(**options)


@real_model
def test_a_message_is_the_greedy_chat_completion_it_amounts_to(client, smol, chat):
    out, prompt_ids, ids = chat
    assert out.choices[0].finish_reason == "stop"  # the model ends its turn before max_tokens
    message = create(client)
    assert message.type == "message" and message.role == "assistant" and message.model == SMOLLM2
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == out.choices[0].message.content == smol[0].get_tokenizer().decode(ids)
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert message.usage.input_tokens == len(prompt_ids) and message.usage.output_tokens == len(ids)


@real_model
def test_max_tokens_and_stop_sequences_end_the_message(client, chat):
    text = chat[0].choices[0].message.content
    cut = create(client, max_tokens=4)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 4)
    assert text.startswith(cut.content[0].text)
    stop = text.split()[2]
    stopped = create(client, stop_sequences=["never appears", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[: text.index(stop)]
    end = list(create(client, stop_sequences=[stop], stream=True))[-2]
    assert (end.delta.stop_reason, end.delta.stop_sequence) == ("stop_sequence", stop)


@real_model
def test_streams_send_anthropics_events_and_the_greedy_text(client, chat):
    whole = create(client)
    raw = list(create(client, stream=True))
    kinds = [event.type for event in raw]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = raw[0].message
    assert (start.content, start.stop_reason, start.usage.input_tokens) == ([], None, whole.usage.input_tokens)
    assert raw[1].content_block.type == "text" and all(event.index == 0 for event in raw[1:-2])
    assert "".join(event.delta.text for event in raw[2:-3]) == whole.content[0].text
    assert (raw[-2].delta.stop_reason, raw[-2].usage.output_tokens) == ("end_turn", whole.usage.output_tokens)

    options = {"model": SMOLLM2, "system": SYSTEM, "messages": ASK, "max_tokens": 60, "extra_body": GREEDY}
    with client.messages.stream(**options) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.usage == whole.usage and final.stop_reason == "end_turn"


@real_model
def test_each_event_is_an_event_line_and_a_data_line_of_its_type(smol):
    body = {"model": SMOLLM2, "messages": ASK, "max_tokens": 3, "stream": True}
    reply = httpx.post(f"{smol[1]}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = reply.text.split("\n\n")
    assert events.pop() == ""
    for text in events:
        kind, data = text.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data.removeprefix("data: "))["type"] == kind.removeprefix("event: ")
    assert [text.split("\n")[0] for text in (events[0], events[-1])] == ["event: message_start", "event: message_stop"]


@real_model
def test_count_tokens_is_the_input_tokens_of_the_same_request(client, smol):
    messages = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
                {"role": "user", "content": [{"type": "text", "text": "Again, "}, {"type": "text", "text": "louder."}]}]
    counted = client.messages.count_tokens(model=SMOLLM2, system=SYSTEM, messages=messages)
    assert counted.input_tokens == create(client, messages=messages, max_tokens=1).usage.input_tokens
    long = [{"role": "user", "content": "word " * 40_000}]  # far over the context: counted, not refused
    assert client.messages.count_tokens(model=SMOLLM2, messages=long).input_tokens > smol[0].engine.config.max_model_len


@real_model
@pytest.mark.parametrize(
    "body, words",
    [
        ({"messages": ASK}, "max_tokens: Field required"),
        ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
        ({"messages": ASK, "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5}, "'image'"),
        ({"messages": [*ASK, {"role": "assistant", "content": "Hel"}], "max_tokens": 5}, "prefill"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}, *ASK],
          "max_tokens": 5}, "tool_result blocks belong in user messages"),
        ({"messages": ASK, "max_tokens": 5, "tool_choice": {"type": "any"}}, "needs tools"),
        ({"messages": ASK, "max_tokens": 5, "surprise": 1}, "surprise"),
        ({"messages": ASK, "max_tokens": 10**6}, "max_model_len"),
    ],
)
def test_bad_input_is_a_400_in_anthropics_shape(smol, body, words):
    reply = httpx.post(f"{smol[1]}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert words in error["error"]["message"], error


@real_model
def test_the_client_raises_anthropics_errors(client, smol):
    with pytest.raises(anthropic.BadRequestError, match="temperature") as err:
        create(client, extra_body={"temperature": -1.0})
    assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as err:
        create(client, model="claude-sonnet-4-5")
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as err:
        create(anthropic.Anthropic(base_url=smol[1], api_key="wrong", max_retries=0))
    assert err.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=SMOLLM2, messages=[])


def test_failures_have_anthropics_error_types():
    assert [error_body(status, "m")["error"]["type"] for status in (400, 401, 404, 413, 500, 503)] == [
        "invalid_request_error", "authentication_error", "not_found_error", "request_too_large", "api_error",
        "overloaded_error"]
    # a stream's failure arrives as the chat stream's error (OpenAI's shape)
    assert stream_error({"message": "shutting down", "type": "server_error", "code": "service_unavailable"}) == {
        "type": "overloaded_error", "message": "shutting down"}
    assert stream_error({"message": "m", "type": "server_error", "code": None})["type"] == "api_error"


def test_a_body_becomes_its_chat_completions_body():
    request = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "stop_sequences": ["END"], "top_k": 5, "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}},
                {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sun"},
                                         {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                          "content": [{"type": "text", "text": "no such city"}]},
                                         {"type": "text", "text": "and then?"}]},
        ],
        "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    })
    request.check_supported()
    calls = [{"id": f"t{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
             for i, c in ((1, "Rome"), (2, "Oslo"))]
    text = lambda *texts: [{"type": "text", "text": t} for t in texts]  # noqa: E731
    assert chat_body(request) == {
        "model": "m", "max_tokens": 9, "stop": ["END"], "top_k": 5, "stream": False,
        "messages": [
            {"role": "system", "content": text("be brief")},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": text("Let me look."), "tool_calls": calls},
            {"role": "tool", "tool_call_id": "t1", "content": text("sun")},
            {"role": "tool", "tool_call_id": "t2", "content": text("Error: ", "no such city")},
            {"role": "user", "content": text("and then?")},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                                    "description": "d"}}],
        "tool_choice": "auto", "parallel_tool_calls": False,
    }
    named = MessagesRequest.model_validate({**request.model_dump(exclude_none=True), "stream": True,
                                            "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert chat_body(named)["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat_body(named)["stream_options"] == {"include_usage": True}


# ---- tools, on a tiny random Qwen 2 with Qwen 2.5's real template (Hermes-style calls) ----------

def anthropic_tool(tool: dict) -> dict:
    function = tool["function"]
    return {"name": function["name"], "description": function.get("description", ""), "input_schema": function["parameters"]}


TOOLS = [anthropic_tool(WEATHER), anthropic_tool(TIME)]
NAMED = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = checkpoint_with_template(tmp_path_factory.mktemp("anthropic_qwen2"), "qwen2", QWEN25)
    with live_server(LLM(str(path), progress=False)) as url:
        yield (anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120),
               openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120))


def ask_weather(client: anthropic.Anthropic, **options):
    options = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "weather in Rome?"}], "tools": TOOLS,
               "tool_choice": NAMED, "max_tokens": 60, "extra_body": GREEDY, **options}
    return client.messages.create(**options)


def test_a_named_tool_is_a_tool_use_block_with_its_input(qwen):
    client, _ = qwen
    message = ask_weather(client)
    (call,) = message.content
    assert (call.type, call.name, message.stop_reason) == ("tool_use", "get_weather", "tool_use")
    assert call.id and isinstance(call.input, dict)
    jsonschema.validate(call.input, WEATHER["function"]["parameters"])

    raw = list(ask_weather(client, stream=True))
    assert [event.type for event in raw[:2]] == ["message_start", "content_block_start"]
    block = raw[1].content_block
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {})
    partial = "".join(e.delta.partial_json for e in raw if e.type == "content_block_delta")
    assert json.loads(partial) == call.input
    assert [event.type for event in raw[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert raw[-2].delta.stop_reason == "tool_use"


def test_any_tool_with_parallel_use_disabled_is_one_valid_call(qwen):
    client, _ = qwen
    message = ask_weather(client, tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=160)
    (call,) = message.content
    schema = next(tool["input_schema"] for tool in TOOLS if tool["name"] == call.name)
    jsonschema.validate(call.input, schema)
    assert message.stop_reason == "tool_use"


def test_a_tool_result_goes_back_as_the_chat_turns_it_amounts_to(qwen):
    client, openai_client = qwen
    first = ask_weather(client)
    (call,) = first.content
    messages = [{"role": "user", "content": "weather in Rome?"}, {"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "22 degrees"}]}]
    reply = ask_weather(client, messages=messages, tool_choice={"type": "none"}, max_tokens=8)
    chat = openai_client.chat.completions.create(
        model=TINY_MODEL, max_tokens=8, tool_choice="none", **GREEDY,
        tools=[{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                 "parameters": t["input_schema"]}} for t in TOOLS],
        messages=[{"role": "user", "content": "weather in Rome?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "22 degrees"}],
    )
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert [block.type for block in reply.content] == ["text"] and reply.content[0].text == chat.choices[0].message.content
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    counted = client.messages.count_tokens(model=TINY_MODEL, messages=messages, tools=TOOLS)
    assert counted.input_tokens == reply.usage.input_tokens


# ---- robustness: mutated bodies ----------------------------------------------------------------

FUZZ_TOOLS = [{"name": "get_time", "input_schema": TIME["function"]["parameters"], "cache_control": {"type": "ephemeral"}}]
FUZZ_HISTORY = [
    {"role": "user", "content": [{"type": "text", "text": "time?"}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time", "input": {"zone": "UTC"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "12:00"}],
                                  "is_error": False}, {"type": "text", "text": "thanks"}]},
]
FUZZ_BASES = [
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "system": "s"}),
    ("/v1/messages", {"messages": FUZZ_HISTORY, "tools": FUZZ_TOOLS, "tool_choice": {"type": "auto"}, "max_tokens": 2,
                      "stop_sequences": ["x"], "top_k": 3, "metadata": {"user_id": "u"}}),
    ("/v1/messages", {"messages": FUZZ_HISTORY, "tools": FUZZ_TOOLS, "tool_choice": {"type": "tool", "name": "get_time"},
                      "max_tokens": 12, "stream": True}),
    ("/v1/messages/count_tokens", {"messages": FUZZ_HISTORY, "tools": FUZZ_TOOLS, "system": [{"type": "text", "text": "s"}]}),
]
FUZZ_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
                | st.sampled_from(["\udfff", "", "image", "tool_use", "tool_result", "text", "assistant", "any", "none"]))
FUZZ_VALUES = st.recursive(
    FUZZ_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def mutated_body(draw) -> tuple[str, dict]:
    """A base body with 1 to 3 values anywhere in it (a field, a block's field, an item) replaced or added."""
    route, base = draw(st.sampled_from(FUZZ_BASES))
    body = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        node = body
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if isinstance(node, dict):
                keys.append(draw(st.sampled_from(["unknown", "type", "content", "input", "thinking", "cache_control"])))
            key = draw(st.sampled_from(keys))
            child = node.get(key) if isinstance(node, dict) else node[key]
            if not isinstance(child, (dict, list)) or not child or draw(st.booleans()):
                node[key] = draw(FUZZ_VALUES)
                break
            node = child
    return route, body


@pytest.fixture(scope="module")
def fuzz_url(tiny_path):
    with live_server(LLM(tiny_path, progress=False, max_model_len=1024), tool_call_parser="hermes") as url:
        yield url


def test_mutated_bodies_get_anthropic_4xx_never_a_server_error(fuzz_url):
    for route, body in FUZZ_BASES:  # the bases themselves are served
        assert httpx.post(f"{fuzz_url}{route}", json=body, timeout=60).status_code == 200, (route, body)

    @given(request=mutated_body())
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(request):
        route, body = request
        content = json.dumps(body, allow_nan=True).encode()
        response = httpx.post(f"{fuzz_url}{route}", content=content, headers={"Content-Type": "application/json"},
                              timeout=60)
        assert response.status_code < 500, (body, response.text)
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith('event: message_stop\ndata: {"type": "message_stop"}\n\n'), response.text
        elif response.status_code >= 400:
            reply = response.json()
            assert reply["type"] == "error" and set(reply["error"]) == {"type", "message"}, reply
            assert reply["error"]["type"] in ("invalid_request_error", "not_found_error"), reply

    check()
    assert httpx.get(f"{fuzz_url}/health", timeout=60).status_code == 200
