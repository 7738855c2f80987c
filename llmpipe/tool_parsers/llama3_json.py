"""Llama 3.x JSON calls: the whole reply is `{"name": "f", "parameters": {...}}` (optionally after
`<|python_tag|>`, several separated by `;`), as the Llama 3.1 / 3.2 / 3.3 Instruct templates ask."""

from __future__ import annotations

from llmpipe.tool_parsers.base import Reading, ToolParser
from llmpipe.tool_parsers.json_calls import read_call, skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def read(self, text: str, final: bool) -> Reading:
        pos = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_space(text, pos + len(PYTHON_TAG))
        elif not final and (pos == len(text) or PYTHON_TAG.startswith(text[pos:])):
            return Reading("")  # nothing yet, or maybe the tag
        elif not text.startswith("{", pos):
            return Reading(text)  # calls come first or not at all: this is content
        reading = Reading(None)
        while True:
            call = read_call(text, pos)
            if call is None or (call.end is None and final):
                return Reading(text) if final else reading
            reading.calls.append(call)
            if call.end is None:
                return reading
            pos = skip_space(text, call.end)
            if pos == len(text):
                return reading
            if text[pos] != ";":
                return Reading(text) if final else reading
            pos = skip_space(text, pos + 1)
