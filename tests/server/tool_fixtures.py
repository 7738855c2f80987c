"""Shared by the tool-calling tests: the models' real chat templates (fixtures/chat_templates), tools
and a conversation that used them, in OpenAI's shape and in the shape transformers' templates take."""

from __future__ import annotations

import copy
import json
from pathlib import Path

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN25, QWEN3 = "qwen2.5-instruct.jinja", "qwen3.jinja"
LLAMA31, LLAMA32 = "llama-3.1-instruct.jinja", "llama-3.2-instruct.jinja"
MISTRAL_NEMO = "mistral-nemo-instruct-2407.jinja"


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}, "precise": {"type": "boolean"}},
            "required": ["zone", "precise"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]
BOUNDED_TOOLS = [WEATHER, TIME]  # every argument an enum or a boolean: a random model's calls end


def call(call_id: str, name: str, arguments: dict) -> dict:
    """A tool call as OpenAI clients send it back: arguments as JSON text."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def history(calls: list[dict]) -> list[dict]:
    """user → assistant calls (no content) → one tool message per call → assistant answer → user."""
    results = [{"role": "tool", "tool_call_id": c["id"], "content": f"result of {c['function']['name']}"} for c in calls]
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *results,
        {"role": "assistant", "content": "It is 18 degrees."},
        {"role": "user", "content": "And in Rome?"},
    ]


def as_transformers_takes_it(messages: list[dict]) -> list[dict]:
    """The same conversation as transformers' docs write it for apply_chat_template: tool-call arguments
    as a dict, the calling turn's content an empty string."""
    messages = copy.deepcopy(messages)
    for message in messages:
        if message.get("content") is None:
            message["content"] = ""
        for tool_call in message.get("tool_calls", []):
            tool_call["function"]["arguments"] = json.loads(tool_call["function"]["arguments"])
    return messages


def checkpoint_with_template(out_dir: Path, arch: str, template_name: str) -> Path:
    """A tiny random checkpoint of `arch` (tests/conftest.py's TINY_CONFIGS) whose tokenizer_config.json
    carries the real chat template `template_name`."""
    from tests.utils import TINY_CONFIGS, build_checkpoint

    class_name, extra = TINY_CONFIGS[arch]
    build_checkpoint(class_name, {**extra, "max_position_embeddings": 4096}, out_dir)  # room for the tools prompt
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)  # it would win over the config's
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["chat_template"] = template(template_name)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    return out_dir


def reassemble_stream(chunks) -> tuple[str | None, list[dict], str | None]:
    """(content, calls, finish_reason) as an OpenAI client builds them from chat.completion.chunk deltas."""
    content, calls, finish_reason = "", [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish_reason = choice.finish_reason or finish_reason
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index == len(calls):
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    return content or None, calls, finish_reason
