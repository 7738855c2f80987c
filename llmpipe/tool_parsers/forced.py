"""Replies the structured-output engine forced into JSON (vLLM's way with `tool_choice`):
"required" → an array of `{"name": ..., "parameters": {...}}`; a named tool → that tool's arguments."""

from __future__ import annotations

import copy
from typing import Any

from llmpipe.tool_parsers.base import Reading, ToolParser
from llmpipe.tool_parsers.json_calls import CallSoFar, is_json, read_call_array, skip_space

NO_PARAMETERS = {"type": "object", "properties": {}}


class RequiredToolParser(ToolParser):
    """`tool_choice: "required"`: the reply is a JSON array of one or more calls."""

    name = "required"

    def read(self, text: str, final: bool) -> Reading:
        pos = skip_space(text, 0)
        if pos == len(text) and not final:
            return Reading(None)
        array = read_call_array(text, pos + 1) if text.startswith("[", pos) else None
        if final and (array is None or array[1] is None or not array[0] or skip_space(text, array[1]) != len(text)):
            return Reading(text)
        return Reading(None, array[0] if array else [])


class NamedToolParser(ToolParser):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: the reply is the arguments."""

    name = "named"

    def __init__(self, tool_name: str) -> None:
        self.tool_name = tool_name

    def read(self, text: str, final: bool) -> Reading:
        arguments = text.strip()
        if final:
            return Reading(None, [CallSoFar(self.tool_name, arguments, len(text))]) if is_json(arguments) else Reading(text)
        return Reading(None, [CallSoFar(self.tool_name, arguments)])


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """vLLM's schema for "required": an array of at least one {name, parameters}, each the name of a
    tool and its parameters' schema; `$defs` of the tools' schemas merged at the top."""
    items = []
    defs: dict[str, Any] = {}
    for tool in tools:
        parameters = copy.deepcopy(tool["function"].get("parameters") or NO_PARAMETERS)
        defs.update(parameters.pop("$defs", {}))
        items.append({
            "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,  # (vLLM leaves it open: a model may then ramble in keys of its own)
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tool: dict) -> dict:
    """The named tool's parameters' schema: its arguments are the whole reply."""
    return tool["function"].get("parameters") or NO_PARAMETERS
