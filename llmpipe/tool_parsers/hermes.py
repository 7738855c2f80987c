"""Hermes-style calls, as Qwen 2.5 / Qwen 3 (and NousResearch Hermes) write them:
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call, after any content.

For a chat template that renders no tools, the format's prompt is written as Qwen 2.5's template
writes it: the tools in a <tools></tools> system prompt, results in <tool_response> blocks."""

from __future__ import annotations

import json

from llmpipe.tool_parsers.base import Reading, ToolParser, certain_prefix
from llmpipe.tool_parsers.json_calls import read_call, skip_space

START, END = "<tool_call>", "</tool_call>"
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class HermesToolParser(ToolParser):
    name = "hermes"
    writes_prompts = True

    def tools_prompt(self, tools: list[dict]) -> str:
        return TOOLS_PROMPT.format(tools="".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools))

    def calls_text(self, calls: list[dict]) -> str:
        return "\n".join(
            f'{START}\n{{"name": {json.dumps(call["function"]["name"], ensure_ascii=False)}, "arguments": '
            f'{json.dumps(json.loads(call["function"]["arguments"]), ensure_ascii=False)}}}\n{END}'
            for call in calls
        )

    def result_text(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

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
