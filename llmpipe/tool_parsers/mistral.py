"""Mistral calls after the `[TOOL_CALLS]` token: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`
(Mistral 7B v0.3, Nemo, Small), or `[TOOL_CALLS]f[ARGS]{...}` per call (tokenizer v11 and later).
Mistral's templates want 9-character alphanumeric call ids, so those are the ids given."""

from __future__ import annotations

import re

from llmpipe.tool_parsers.base import Reading, ToolParser, certain_prefix, random_alphanumeric
from llmpipe.tool_parsers.json_calls import CallSoFar, is_json, read_call_array, skip_space, value_end

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


class MistralToolParser(ToolParser):
    name = "mistral"
    reads_special_tokens = True  # [TOOL_CALLS]

    def new_id(self) -> str:
        return random_alphanumeric(9)

    def read(self, text: str, final: bool) -> Reading:
        first = text.find(MARKER)
        if first < 0:
            return Reading(text if final else certain_prefix(text, MARKER))
        reading = Reading(text[:first].rstrip() or None)
        pos = skip_space(text, first + len(MARKER))
        if text.startswith("[", pos):
            array = read_call_array(text, pos + 1)
            if final and (array is None or array[1] is None or not array[0]):
                return Reading(text)
            reading.calls.extend(array[0] if array else [])
            return reading
        return self._read_named(text, first, reading, final)

    def _read_named(self, text: str, start: int, reading: Reading, final: bool) -> Reading:
        """`[TOOL_CALLS]name[ARGS]{json}`, repeated."""
        while start >= 0:
            pos = start + len(MARKER)
            name = _NAME.match(text, pos)
            args = name.end() if name else pos
            if name is None or not text.startswith(ARGS, args):
                return Reading(text) if final else reading
            begin = skip_space(text, args + len(ARGS))
            end = value_end(text, begin) if text.startswith(("{", "["), begin) else None
            if end is None or not is_json(text[begin:end]):
                opening = begin == len(text) or (end is None and text[begin] in "{[")
                if final or not opening:
                    return Reading(text) if final else reading
                reading.calls.append(CallSoFar(name.group(), text[begin:]))
                return reading
            reading.calls.append(CallSoFar(name.group(), text[begin:end], end))
            start = text.find(MARKER, end)
        return reading

