"""POST /v1/responses with the official openai client: the same conversation as chat completions
(whose tokens are checked against transformers), reshaped into OpenAI's response object and events."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch
import transformers

from llmpipe import LLM
from llmpipe.server.protocol import ResponsesRequest
from tests.server.utils import TINY_MODEL, live_server
from tests.server.references import assert_greedy_matches, hf_greedy, token_ids_of
from tests.server.tool_fixtures import QWEN25, TIME, WEATHER, checkpoint_with_template

MESSAGES = [{"role": "user", "content": "how does inference work?"}]


@pytest.fixture(scope="module")
def client(tiny_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(tiny_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(tiny_path)


def chat_greedy(client, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(
        model=TINY_MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )


def test_text_input_is_the_chat_turn_transformers_continues(client, hf):
    model, tokenizer = hf
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    chat = chat_greedy(client, MESSAGES, 10)
    ids = token_ids_of([item.token for item in chat.choices[0].logprobs.content])
    assert_greedy_matches(ids, hf_greedy(model, prompt_ids, len(ids)))

    out = client.responses.create(model=TINY_MODEL, input=MESSAGES[0]["content"], max_output_tokens=10, temperature=0.0)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == TINY_MODEL
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == len(prompt_ids) and out.usage.output_tokens == len(ids)
    assert out.usage.total_tokens == len(prompt_ids) + len(ids)
    message = out.output[0]
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    if chat.choices[0].finish_reason == "length":
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed" and out.incomplete_details is None


def test_instructions_and_message_items_render_as_system_and_turns(client, tiny_path):
    items = [
        {"role": "user", "content": "hello"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi there"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "and "}, {"type": "input_text", "text": "then?"}]},
    ]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "and then?"}]
    prompt_ids = transformers.AutoTokenizer.from_pretrained(tiny_path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    out = client.responses.create(model=TINY_MODEL, instructions="be brief", input=items, max_output_tokens=6,
                                  temperature=0.0)
    assert out.usage.input_tokens == len(prompt_ids)
    assert out.instructions == "be brief" and out.max_output_tokens == 6
    assert out.output_text == chat_greedy(client, messages, 6).choices[0].message.content


def test_stream_events_build_the_same_response(client):
    options = dict(model=TINY_MODEL, input="tell me a story", max_output_tokens=12, temperature=1.0,
                   extra_body={"seed": 5})
    whole = client.responses.create(**options)
    events = list(client.responses.create(stream=True, **options))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens == 12
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"


def test_output_text_logprobs_when_included(client):
    out = client.responses.create(model=TINY_MODEL, input="hi", max_output_tokens=5, temperature=0.0, top_logprobs=2,
                                  include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0.0, logprobs=True, top_logprobs=2)
    logprobs = out.output[0].content[0].logprobs
    assert [lp.token for lp in logprobs] == [item.token for item in chat.choices[0].logprobs.content]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in logprobs]),
                               torch.tensor([item.logprob for item in chat.choices[0].logprobs.content]))
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_what_is_not_supported_is_a_400_naming_the_field(tiny_url, extra, param):
    body = {"model": TINY_MODEL, "input": "hi", **extra}
    reply = httpx.post(f"{tiny_url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith(param), reply.json()


def test_a_function_call_output_without_call_id_is_a_400_naming_it(tiny_url):
    body = {"model": TINY_MODEL, "input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "output": "x"}]}
    reply = httpx.post(f"{tiny_url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "input" and error["code"] == "missing_required_parameter"
    assert "input: [1].call_id: Field required" in error["message"]


def test_function_call_items_become_an_assistant_tool_call_turn_and_a_tool_message():
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    second = {**call, "call_id": "call_2", "arguments": '{"city": "Rome"}'}
    request = ResponsesRequest.model_validate({
        "input": [
            {"role": "user", "content": "weather?"},
            call,
            second,
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "sun"}]},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
    })
    body = request.chat_body()
    tool_calls = [{"id": c["call_id"], "type": "function",
                   "function": {"name": c["name"], "arguments": c["arguments"]}} for c in (call, second)]
    assert body["messages"] == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sun"},
    ]
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True}}
    assert json.loads(json.dumps(body)) == body


@pytest.fixture(scope="module")
def qwen_client(tmp_path_factory) -> openai.OpenAI:
    """A tiny random Qwen 2 with Qwen 2.5's real template (it writes tool calls as Hermes does)."""
    path = checkpoint_with_template(tmp_path_factory.mktemp("responses_qwen2"), "qwen2", QWEN25)
    with live_server(LLM(str(path), progress=False)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def responses_tool(tool: dict) -> dict:
    """A chat completions tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"], "strict": True}


def test_a_named_function_tool_is_a_function_call_item_with_valid_arguments(qwen_client):
    options = dict(model=TINY_MODEL, input="weather in Rome?", tools=[responses_tool(WEATHER), responses_tool(TIME)],
                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60, temperature=1.0,
                   extra_body={"seed": 3})
    out = qwen_client.responses.create(**options)
    (call,) = out.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_") and out.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])

    events = list(qwen_client.responses.create(stream=True, **options))
    kinds = [event.type for event in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    streamed = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    assert streamed == done.arguments == call.arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == call.arguments


def test_a_function_call_and_its_output_go_back_to_the_model_as_chat_turns(qwen_client):
    call = {"type": "function_call", "call_id": "call_7", "name": "get_weather",
            "arguments": '{"city": "Rome", "unit": "celsius"}'}
    items = [{"role": "user", "content": "weather in Rome?"}, call,
             {"type": "function_call_output", "call_id": "call_7", "output": "22 degrees"}]
    messages = [{"role": "user", "content": "weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
                {"role": "tool", "tool_call_id": "call_7", "content": "22 degrees"}]
    out = qwen_client.responses.create(model=TINY_MODEL, input=items, tools=[responses_tool(WEATHER)],
                                       tool_choice="none", max_output_tokens=8, temperature=0.0)
    chat = qwen_client.chat.completions.create(model=TINY_MODEL, messages=messages, tool_choice="none",
                                               tools=[{"type": "function", "function": {**WEATHER["function"], "strict": True}}],
                                               max_tokens=8, temperature=0.0)
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.output_text == chat.choices[0].message.content
