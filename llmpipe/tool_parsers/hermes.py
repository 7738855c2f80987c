"""Hermes-style calls, as Qwen 2.5 / Qwen 3 (and NousResearch Hermes) write them:
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call, after any content."""

from __future__ import annotations

from llmpipe.tool_parsers.base import Reading, ToolParser, certain_prefix
from llmpipe.tool_parsers.json_calls import read_call, skip_space

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def read(self, text: str, final: bool) -> Reading:
        first = text.find(START)
        if first < 0:
            return Reading(text if final else certain_prefix(text, START))
        reading = Reading(text[:first].rstrip() or None)
        start = first
        while start >= 0:
            body = start + len(START)
            close = text.find(END, body)
            body_end = close if close >= 0 else len(text)
            call = read_call(text[:body_end], skip_space(text, body))
            complete = call is not None and call.end is not None and skip_space(text[:body_end], call.end) == body_end
            if not complete:  # malformed, or still being written
                if final:
                    return Reading(text)
                if call is not None:
                    reading.calls.append(call)
                return reading
            reading.calls.append(call)
            start = text.find(START, body_end) if close >= 0 else -1
        return reading
