"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

Checked as strictly as the OpenAI routes' bodies (server/protocol.py): types are strict, unknown
fields are a 400, and fields Anthropic defines that llmpipe cannot honour (extended thinking, server
tools' containers, MCP servers, ...) are refused with a 400 naming them. Only text, tool_use and
tool_result blocks are accepted; `cache_control` and `citations` are accepted anywhere Anthropic
allows them and ignored (the prefix cache needs no hints). The conversion to a chat completions body
is server/anthropic.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from llmpipe.errors import InvalidRequestError
from llmpipe.server.protocol import (
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    Int64,
    Refused,
    StopString,
    Text,
    _Body,
    _one_of,
    refusing,
)

Ignored = Any  # cache_control, citations: accepted as sent, no effect


class TextBlock(_Body):
    type: Literal["text"]
    text: Text
    cache_control: Ignored = None
    citations: Ignored = None


class ToolUseBlock(_Body):
    """A call the assistant made, in the conversation's history."""

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[Text, Any]
    cache_control: Ignored = None


TextContent = Annotated[
    Text | Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)],
    _one_of("a string or a list of text blocks ({'type': 'text', 'text': ...})"),
]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: TextContent | None = None
    is_error: bool = False
    cache_control: Ignored = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]
OWN_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}


class Message(_Body):
    role: Literal["user", "assistant"]
    content: Annotated[
        Text | Annotated[list[Block], Field(max_length=MAX_MESSAGES)],
        _one_of("a string or a list of text, tool_use or tool_result blocks"),
    ]

    def check_supported(self) -> None:
        for j, block in enumerate(self.content if isinstance(self.content, list) else ()):
            if block.type not in OWN_BLOCKS[self.role]:
                owner = "assistant" if self.role == "user" else "user"
                raise InvalidRequestError(f"content[{j}]: {block.type} blocks belong in {owner} messages",
                                          param=f"content[{j}].type")


class Tool(_Body):
    """A client tool (Anthropic's server tools, such as web search, are not supported)."""

    name: Annotated[Text, Field(min_length=1, max_length=256)]
    input_schema: dict[Text, Any] = Field(description="a JSON schema of the tool's input")
    description: Text | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: Ignored = None


class ToolChoiceAuto(_Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Body):
    type: Literal["tool"]
    name: Text
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Body):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]
NO_THINKING = "extended thinking is not supported"
REFUSED_INPUT = {
    "thinking": Refused(NO_THINKING, (None, {"type": "disabled"})),
    "mcp_servers": Refused("MCP servers are not supported", (None, [])),
    "context_management": Refused("context management is not supported"),
    "output_config": Refused("output_config (effort, output formats) is not supported"),
    "container": Refused("containers (for server tools) are not supported"),
}


@refusing
class CountTokensRequest(_Body):
    """What shapes the prompt: the body of /v1/messages/count_tokens, and the base of a Messages request."""

    model: Text | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: TextContent | None = Field(None, description="the system prompt: a system message first")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: Ignored = Field(None, description="accepted, ignored: prefix caching is automatic")
    REFUSED: ClassVar[dict[str, Refused]] = REFUSED_INPUT

    def check_supported(self) -> None:
        super().check_supported()
        for i, message in enumerate(self.messages):
            try:
                message.check_supported()
            except InvalidRequestError as err:
                raise InvalidRequestError(f"messages[{i}].{err}", param=f"messages[{i}].{err.param}") from None
        if self.messages[-1].role == "assistant":
            raise InvalidRequestError(
                "messages: a final assistant message (prefill, which the reply would continue) is not supported; "
                "end with a user message", param=f"messages[{len(self.messages) - 1}].role",
            )
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise InvalidRequestError(f"tool_choice: {{'type': {choice.type!r}}} needs tools", param="tool_choice")


@refusing
class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)]
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    stream: bool = False
    metadata: dict[Text, Any] | None = Field(None, description="accepted, ignored")
    REFUSED: ClassVar[dict[str, Refused]] = {
        **REFUSED_INPUT,
        "service_tier": Refused("there is one service tier", (None, "auto", "standard_only")),
        "speed": Refused("there is one speed", (None, "standard")),
        "inference_geo": Refused("requests run where the server runs"),
    }
