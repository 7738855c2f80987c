"""LangChain's ChatOpenAI against llmpipe serve (a tiny random Qwen 2 with Qwen 2.5's real template):
bind_tools and with_structured_output, whose replies structured outputs hold to the schemas."""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from llmpipe import LLM
from tests.server.utils import TINY_MODEL, live_server
from tests.server.tool_fixtures import QWEN25, checkpoint_with_template

QUESTION = "What is the weather in Paris?"


class Weather(BaseModel):
    """Look up the weather in a city."""

    city: Literal["Paris", "Rome"]
    unit: Literal["celsius", "fahrenheit"]


class Time(BaseModel):
    """Look up the time in a zone."""

    zone: Literal["UTC", "CET"]
    precise: bool


MODELS = {"Weather": Weather, "Time": Time}


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> ChatOpenAI:
    path = checkpoint_with_template(tmp_path_factory.mktemp("langchain_qwen2"), "qwen2", QWEN25)
    with live_server(LLM(str(path), progress=False)) as url:
        yield ChatOpenAI(base_url=f"{url}/v1", api_key="x", model=TINY_MODEL, temperature=0.0, max_tokens=160,
                         max_retries=0, timeout=120)


def assert_calls_valid(tool_calls: list[dict], names: set[str]) -> None:
    assert tool_calls
    for tool_call in tool_calls:
        assert tool_call["name"] in names and tool_call["id"].startswith("call_")
        MODELS[tool_call["name"]].model_validate(tool_call["args"])


@pytest.mark.parametrize("tool_choice,names", [("Time", {"Time"}), ("any", {"Weather", "Time"})])
def test_bind_tools_returns_tool_calls(chat, tool_choice, names):
    message = chat.bind_tools([Weather, Time], tool_choice=tool_choice, strict=True, parallel_tool_calls=False).invoke(QUESTION)
    assert not message.invalid_tool_calls
    assert_calls_valid(message.tool_calls, names)
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_bind_tools_streams_tool_call_chunks(chat):
    bound = chat.bind_tools([Weather, Time], tool_choice="Weather", strict=True)
    chunks = list(bound.stream(QUESTION))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert len(chunks) > 3  # the arguments came in pieces
    assert_calls_valid(merged.tool_calls, {"Weather"})
    whole = bound.invoke(QUESTION).tool_calls
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in whole]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output_returns_the_model(chat, method):
    result = chat.with_structured_output(Time, method=method, strict=True).invoke(QUESTION)
    assert isinstance(result, Time)


@pytest.fixture(scope="module")
def responses_chat(chat) -> ChatOpenAI:
    """The same server through OpenAI's Responses API (POST /v1/responses)."""
    return ChatOpenAI(base_url=chat.openai_api_base, api_key="x", model=TINY_MODEL, temperature=0.0, max_tokens=160,
                      max_retries=0, timeout=120, use_responses_api=True)


def test_responses_api_answers_like_chat_completions(chat, responses_chat):
    chat_reply = chat.invoke(QUESTION)
    reply = responses_chat.invoke(QUESTION)
    assert reply.text == chat_reply.text
    assert reply.usage_metadata["input_tokens"] == chat_reply.usage_metadata["input_tokens"]


@pytest.mark.parametrize("tool_choice,names", [("Time", {"Time"}), ("any", {"Weather", "Time"})])
def test_responses_api_bind_tools_returns_tool_calls(responses_chat, tool_choice, names):
    bound = responses_chat.bind_tools([Weather, Time], tool_choice=tool_choice, strict=True, parallel_tool_calls=False)
    message = bound.invoke(QUESTION)
    assert not message.invalid_tool_calls
    assert_calls_valid(message.tool_calls, names)
