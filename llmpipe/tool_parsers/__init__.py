"""Tool-call parsers: a model's output text → (content, tool calls), whole or as a stream of
OpenAI deltas. One per format models are trained on, registered by the name `--tool-call-parser` takes."""

from __future__ import annotations

from llmpipe.tool_parsers.base import ToolCall, ToolCallStream, ToolParser, parse_tool_calls
from llmpipe.tool_parsers.forced import NamedToolParser, RequiredToolParser, named_schema, required_schema
from llmpipe.tool_parsers.hermes import HermesToolParser
from llmpipe.tool_parsers.llama3_json import Llama3JsonToolParser
from llmpipe.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"no tool-call parser {name!r}; there are {', '.join(sorted(TOOL_PARSERS))}") from None


def parser_for_template(template: str | None) -> str | None:
    """The parser for the call format a chat template teaches its model, or None when none is recognised."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return None


__all__ = [
    "TOOL_PARSERS", "NamedToolParser", "RequiredToolParser", "ToolCall", "ToolCallStream", "ToolParser",
    "get_tool_parser", "named_schema", "parse_tool_calls", "parser_for_template", "required_schema",
]
