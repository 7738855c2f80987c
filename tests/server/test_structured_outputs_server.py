"""Structured outputs through the server: OpenAI's response_format, vLLM's structured_outputs and
guided_* fields, streaming, the engine core in its own process, and the official openai client's
chat.completions.parse(PydanticModel). Outputs are checked with jsonschema / re / pydantic."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.utils import TINY_MODEL, core_process_engine, live_server

CHAT = [{"role": "user", "content": "describe a city as JSON"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "population": {"type": "integer", "minimum": 0,
                                                                              "maximum": 10**7},
                   "kind": {"enum": ["town", "city"]}},
    "required": ["city", "population", "kind"],
    "additionalProperties": False,
}


class Address(BaseModel):
    street: str = Field(max_length=10)
    number: int = Field(ge=1, le=999)


class Person(BaseModel):
    name: str = Field(max_length=8)
    role: Literal["admin", "user"]
    address: Address
    tags: list[str] = Field(max_length=2)


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", json={"model": TINY_MODEL, **body}, timeout=120)


def sse_text(url: str, route: str, body: dict) -> dict[int, str]:
    """Each choice's text, joined from a streamed reply's deltas."""
    texts: dict[int, str] = {}
    with httpx.stream("POST", f"{url}{route}", json={"model": TINY_MODEL, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return texts


def test_openai_client_parse_returns_the_pydantic_model(tiny_url):
    client = openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0, timeout=120)
    completion = client.chat.completions.parse(model=TINY_MODEL, messages=CHAT, response_format=Person,
                                               temperature=1.0, seed=3, n=3)
    for choice in completion.choices:
        assert isinstance(choice.message.parsed, Person)
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_response_format_json_schema_on_chat_and_completions(tiny_url):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    chat = post(tiny_url, "/v1/chat/completions", {"messages": CHAT, "response_format": response_format, "n": 4,
                                                   "seed": 1})
    completion = post(tiny_url, "/v1/completions", {"prompt": "a city:", "response_format": response_format, "n": 4,
                                                    "seed": 2, "max_tokens": 900})
    texts = [c["message"]["content"] for c in chat.json()["choices"]]
    texts += [c["text"] for c in completion.json()["choices"]]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_vllm_fields(tiny_url):
    body = {"prompt": "x", "n": 4, "seed": 5, "max_tokens": 64}
    picked = post(tiny_url, "/v1/completions", {**body, "structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert {c["text"] for c in picked.json()["choices"]} <= {"red", "green", "blue"}
    legacy = post(tiny_url, "/v1/completions", {**body, "guided_choice": ["up", "down"]})
    assert {c["text"] for c in legacy.json()["choices"]} <= {"up", "down"}
    for field in ("guided_regex", "structured_outputs"):
        value = "[0-9]{3}-[a-z]{2}" if field == "guided_regex" else {"regex": "[0-9]{3}-[a-z]{2}"}
        for choice in post(tiny_url, "/v1/completions", {**body, field: value}).json()["choices"]:
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", choice["text"]), choice
    grammar = 'root ::= ("ab" | "c") ("," ("ab" | "c")){0,2}'
    for choice in post(tiny_url, "/v1/completions", {**body, "guided_grammar": grammar}).json()["choices"]:
        assert re.fullmatch(r"(ab|c)(,(ab|c)){0,2}", choice["text"]), choice
    compact = {**body, "max_tokens": 400, "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    for choice in post(tiny_url, "/v1/completions", compact).json()["choices"]:
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_streamed_structured_outputs_through_the_engine_core_process(tiny_path):
    with live_server(core_process_engine(tiny_path)) as url:
        chat = sse_text(url, "/v1/chat/completions", {
            "messages": CHAT, "n": 3, "seed": 4, "max_tokens": 400,
            "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
        completion = sse_text(url, "/v1/completions", {"prompt": "x", "n": 3, "seed": 4, "max_tokens": 64,
                                                       "guided_regex": "[a-z]{4,9}"})
    assert len(chat) == 3 and len(completion) == 3
    for text in chat.values():
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in completion.values():
        assert re.fullmatch("[a-z]{4,9}", text), text


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "[a-z"}, "guided_regex"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": 'root ::= ("a" |'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 3, "maxLength": 1}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(tiny_url, body, param):
    response = post(tiny_url, "/v1/completions", {"prompt": "x", "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
