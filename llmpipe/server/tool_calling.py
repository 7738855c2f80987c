"""Tool calling on the chat route, as vLLM does it: with `tool_choice` "auto" the reply is read by the
model's tool-call parser; "required" and a named tool constrain the reply to JSON with structured
outputs, which is then read as the calls directly.

Tools and calls reach the prompt through the chat template, or, when the template renders none
(SmolLM2's), written in the parser's own documented format (see template_input)."""

from __future__ import annotations

from dataclasses import dataclass

from llmpipe.errors import InvalidRequestError
from llmpipe.sampling_params import SamplingParams, StructuredOutputsParams
from llmpipe.server.protocol import ChatCompletionRequest, TokenizeRequest, template_tools
from llmpipe.structured_output import check_structured_outputs
from llmpipe.tokenizer.chat_template import template_variables
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
    if not (renders_tools(template) or parser.writes_prompts):
        raise InvalidRequestError(
            f"tools: this model's chat template renders no tools, and the {name} format has no prompt llmpipe "
            f"writes them in, so the model would never see them; start the server with --tool-call-parser "
            f"{' or '.join(sorted(n for n, p in TOOL_PARSERS.items() if p.writes_prompts))}, or send tool_choice "
            "'required' or a named tool (both enforced with structured outputs)",
            param="tools",
        )
    return ToolCalling(FirstCallOnly(parser) if single else parser)


def template_input(
    body: ChatCompletionRequest | TokenizeRequest, parser_name: str | None, template: str | None
) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as the chat template gets them.

    A template that renders no tools, or no assistant tool calls (SmolLM2's), would drop them without
    a word. When the parser (--tool-call-parser, or the one the template shows) documents a prompt
    format, they are written in it instead, so the model sees what the parser will read: Hermes' tools
    in a <tools></tools> system prompt, calls as <tool_call>{...}</tool_call> text in the assistant's
    turn, results as <tool_response> text. With no such parser, calls in the history are a 400 (the
    turn would render empty); of the tools, "auto" refuses them (tool_calling), "required" and a named
    tool hold the reply to their schemas with structured outputs, and "none" asks for no call.
    """
    messages = [message.as_template_input() for message in body.messages]
    tools = template_tools(body.tools)
    if not template:
        return messages, tools  # the tokenizer says there is no template
    name = parser_name or parser_for_template(template)
    writer = get_tool_parser(name) if name is not None else None
    writer = writer if writer is not None and writer.writes_prompts else None
    if tools and writer is not None and not renders_tools(template):
        messages, tools = _with_system_prompt(messages, writer.tools_prompt(tools)), None
    if "tool_calls" not in template:  # the template never reads a message's calls
        messages = [_calls_as_text(i, message, writer) for i, message in enumerate(messages)]
    return messages, tools


def renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template_variables(template)


def _with_system_prompt(messages: list[dict], prompt: str) -> list[dict]:
    """`prompt` after the conversation's system message, or as one."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}" if first["content"] else prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _calls_as_text(i: int, message: dict, writer: ToolParser | None) -> dict:
    """A message whose calls or result the template cannot render, in `writer`'s format (None: a 400)."""
    if message["role"] == "tool" and writer is not None:
        return {**message, "content": writer.result_text(message["content"])}
    if not message.get("tool_calls"):
        return message
    if writer is None:
        raise InvalidRequestError(
            f"messages[{i}].tool_calls: this model's chat template renders no tool calls, so the turn would be "
            "sent empty; start the server with a --tool-call-parser whose format llmpipe writes into the prompt "
            f"({', '.join(sorted(n for n, p in TOOL_PARSERS.items() if p.writes_prompts))})",
            param=f"messages[{i}].tool_calls",
        )
    calls = writer.calls_text(message["tool_calls"])
    content = f"{message['content']}\n{calls}" if message["content"] else calls
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": content}


def _json(schema: dict) -> StructuredOutputsParams:
    """The constraint, checked here so that a tool's bad parameters schema is a 400 naming `tools`.
    Compact JSON: the calls end as soon as their schema allows, with no whitespace for a model to loop in."""
    return check_structured_outputs(StructuredOutputsParams(json=schema, disable_any_whitespace=True), field="tools")


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
