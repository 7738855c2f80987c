"""Tool calling on the chat route, as vLLM does it: with `tool_choice` "auto" the reply is read by the
model's tool-call parser; "required" and a named tool constrain the reply to JSON with structured
outputs, which is then read as the calls directly."""

from __future__ import annotations

from dataclasses import dataclass

from llmpipe.errors import InvalidRequestError
from llmpipe.sampling_params import SamplingParams, StructuredOutputsParams
from llmpipe.server.protocol import ChatCompletionRequest, template_tools
from llmpipe.structured_output import check_structured_outputs
from llmpipe.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    get_tool_parser,
    named_schema,
    parser_for_template,
    required_schema,
)
from llmpipe.tool_parsers.base import Reading


@dataclass
class ToolCalling:
    """How one request's reply is read for calls (parser None: not at all) and what constrains it."""

    parser: ToolParser | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def apply(self, params: SamplingParams) -> None:
        if self.structured_outputs is not None:
            if params.structured_outputs is not None:
                raise InvalidRequestError(
                    "tool_choice: 'required' and a named tool are structured outputs of their own; they cannot be "
                    "combined with response_format or structured_outputs", param="tool_choice"
                )
            params.structured_outputs = self.structured_outputs
        if self.parser is not None and self.parser.reads_special_tokens:
            params.skip_special_tokens = False


def tool_calling(body: ChatCompletionRequest, parser_name: str | None, template: str | None) -> ToolCalling:
    """The plan for `body`; `parser_name` is the server's --tool-call-parser (None: chosen from the template)."""
    mode = body.tool_choice_mode
    if mode == "none":
        return ToolCalling()
    tools = template_tools(body.tools)
    single = body.parallel_tool_calls is False
    name = parser_name or parser_for_template(template)
    if mode in ("required", "named"):
        if mode == "required":
            forced, schema = RequiredToolParser(), required_schema(tools, parallel=not single)
        else:
            tool = body.named_tool()
            forced, schema = NamedToolParser(tool["function"]["name"]), named_schema(tool)
        if name is not None:  # call ids the model's own template accepts back (Mistral's: 9 characters)
            forced.new_id = get_tool_parser(name).new_id
        return ToolCalling(forced, _json(schema))
    if name is None:
        raise InvalidRequestError(
            "tools: this model's chat template shows no tool-call format llmpipe can read, so calls would be lost; "
            f"start the server with --tool-call-parser ({', '.join(sorted(TOOL_PARSERS))}), or send tool_choice "
            "'required' or a named tool (both enforced with structured outputs)",
            param="tools",
        )
    parser = get_tool_parser(name)
    return ToolCalling(FirstCallOnly(parser) if single else parser)


def _json(schema: dict) -> StructuredOutputsParams:
    """The constraint, checked here so that a tool's bad parameters schema is a 400 naming `tools`.
    Compact JSON: the calls end as soon as their schema allows, with no whitespace for a model to loop in."""
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    check_structured_outputs(spec, field="tools")
    return spec


class FirstCallOnly(ToolParser):
    """`parallel_tool_calls: false` with "auto": any call after the first is dropped."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.name = parser.name
        self.reads_special_tokens = parser.reads_special_tokens

    def new_id(self) -> str:
        return self.parser.new_id()

    def read(self, text: str, final: bool) -> Reading:
        reading = self.parser.read(text, final)
        reading.calls = reading.calls[:1]
        return reading
