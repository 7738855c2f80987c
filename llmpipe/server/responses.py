"""OpenAI's Responses API (`POST /v1/responses`) as a shape over chat completions.

A Responses body becomes a chat completions body (instructions → a system message, input items →
messages, function_call / function_call_output items → assistant tool_calls / tool messages,
text.format → response_format, function tools → chat tools), so one code path templates, samples
and parses tool calls for both routes. The chat reply, or its stream of chunks, is then reshaped
into a `response` object, or into Responses' typed stream events (`response.created`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ..., `response.completed`).

No state is kept between responses: `previous_response_id` and `store: true` are refused with a
400, and a client sends the whole conversation as `input` (as it may on OpenAI with store=false).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, ClassVar, Literal

from pydantic import Field

from llmpipe.errors import InvalidRequestError
from llmpipe.server.protocol import (
    MAX_LOGPROBS,
    MAX_MESSAGES,
    Int64,
    Refused,
    Text,
    _Body,
    _one_of,
    refusing,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
STATELESS = "responses are not stored: send the whole conversation as input"


class InputText(_Body):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None  # on output_text parts a client sends back
    logprobs: list[Any] | None = None


PartList = Annotated[list[InputText], Field(max_length=MAX_MESSAGES)]
MessageContent = Annotated[
    Text | PartList, _one_of("a string or a list of input_text parts ({'type': 'input_text', 'text': ...})")
]


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: MessageContent
    id: Text | None = None  # set on output items a client sends back
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCall(_Body):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: Text
    output: MessageContent
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


InputItem = Annotated[
    InputMessage | FunctionCall | FunctionCallOutput,
    _one_of("a message, a function_call or a function_call_output item"),
]
Input = Annotated[
    Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)],
    _one_of("a string or a list of input items"),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict[Text, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters or {"type": "object", "properties": {}}}
        function.update({k: v for k, v in (("description", self.description), ("strict", self.strict)) if v is not None})
        return {"type": "function", "function": function}


class ToolChoiceFunction(_Body):
    type: Literal["function"]
    name: Text


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[Text, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None

    def as_response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None:
            raise InvalidRequestError("text.format.schema is required for json_schema", param="text.format.schema")
        spec = {"name": self.name or "response", "schema": self.schema_}
        spec.update({k: v for k, v in (("description", self.description), ("strict", self.strict)) if v is not None})
        return {"type": "json_schema", "json_schema": spec}


@refusing
class TextConfig(_Body):
    format: TextFormat | None = None
    REFUSED: ClassVar[dict[str, Refused]] = {"verbosity": Refused("verbosity controls are not supported", (None, "medium"))}


@refusing
class ResponsesStreamOptions(_Body):
    REFUSED: ClassVar[dict[str, Refused]] = {"include_obfuscation": Refused("stream obfuscation is not supported", (None, False))}


@refusing
class ResponsesRequest(_Body):
    model: Text | None = None
    input: Input
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        None, description="only message.output_text.logprobs (the output text's token logprobs)"
    )
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_MESSAGES)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Annotated[dict[Text, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = Field(
        None, description="returned as sent"
    )
    user: Text | None = Field(None, description="the end user, as OpenAI defines it: logged, no effect on the output")
    safety_identifier: Text | None = Field(None, description="as user")
    seed: Int64 | None = Field(None, description="vLLM's extra: seeded sampling")
    REFUSED: ClassVar[dict[str, Refused]] = {
        "previous_response_id": Refused(STATELESS),
        "store": Refused(STATELESS + " (store must be false)", (None, False)),
        "conversation": Refused(STATELESS),
        "background": Refused("background responses are not supported", (None, False)),
        "background_options": Refused("background responses are not supported"),
        "truncation": Refused("a prompt over the context is refused, not truncated", (None, "disabled")),
        "reasoning": Refused("reasoning controls are not supported"),
        "prompt": Refused("stored prompt templates are not supported"),
        "max_tool_calls": Refused("max_tool_calls is not supported"),
        "service_tier": Refused("there is one service tier", (None, "auto", "default")),
        "prompt_cache_key": Refused("prefix caching is automatic and needs no key"),
        "prompt_cache_retention": Refused("prefix caching is automatic and needs no settings"),
        "prompt_cache_options": Refused("prefix caching is automatic and needs no settings"),
        "context_management": Refused("context management is not supported"),
        "moderation": Refused("moderation is not supported"),
        "image": Refused("images are not supported"),
        "access_programs": Refused("access programs are not supported"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        for part in (self.text, self.stream_options):
            if part is not None:
                part.check_supported()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed when stream is true", param="stream_options")

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ())

    def chat_body(self) -> dict:
        """The same request as a chat completions body."""
        body: dict[str, Any] = {"messages": self.messages(), "stream": self.stream}
        optional = {
            "model": self.model,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "user": self.user,
            "safety_identifier": self.safety_identifier,
            "seed": self.seed,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.wants_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            body["tools"] = [tool.as_chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, ToolChoiceFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.as_response_format()
        return body

    def messages(self) -> list[dict]:
        """instructions first (as a system message), then the input items as chat messages; function
        calls in a row join one assistant turn, as the model produced them."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallOutput):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            else:
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
        return messages

    def echo(self) -> dict:
        """The request's settings as the response object repeats them."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_logprobs": self.top_logprobs,
            "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)}
            if self.text is not None and self.text.format is not None
            else {"format": {"type": "text"}},
            "tools": [{"strict": None, "description": None, "parameters": None, **t.model_dump(exclude_none=True)}
                      for t in self.tools or ()],
            "tool_choice": self.tool_choice.model_dump() if isinstance(self.tool_choice, ToolChoiceFunction)
            else self.tool_choice or "auto",
            "truncation": "disabled",
            "user": self.user,
            "safety_identifier": self.safety_identifier,
        }


CHAT_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "messages": "input",
               "response_format": "text.format", "top_logprobs": "top_logprobs"}


def chat_error(err: InvalidRequestError) -> InvalidRequestError:
    """A chat completions error, naming the Responses field it came from."""
    param = err.param or ""
    head, _, rest = param.partition(".")
    name = CHAT_PARAMS.get(head.split("[")[0])
    if name is None:
        return err
    message = str(err).replace(head.split("[")[0], name, 1)
    return InvalidRequestError(message, param=name + (f".{rest}" if rest else ""), code=err.code)


class ResponseShape:
    """Chat completion replies and chunks → one `response` object and its stream events."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.request = request
        self.model = model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"

    # ---- whole replies --------------------------------------------------------------------

    def body(self, chat: dict) -> dict:
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if message.get("content"):
            output.append(self._message_item(message["content"], (choice.get("logprobs") or {}).get("content")))
        output += [self._call_item(call) for call in message.get("tool_calls") or ()]
        return self._response(output, choice["finish_reason"], chat.get("usage"))

    def _response(self, output: list[dict], finish_reason: str | None, usage: dict | None) -> dict:
        status = {None: "in_progress", "length": "incomplete"}.get(finish_reason, "completed")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": output,
            "usage": responses_usage(usage) if usage else None,
            **self.request.echo(),
        }

    def _message_item(self, text: str, logprobs: list[dict] | None, status: str = "completed") -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [part] if status == "completed" else []}

    @staticmethod
    def _call_item(call: dict, status: str = "completed") -> dict:
        function = call["function"]
        return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "name": function["name"],
                "arguments": function.get("arguments") or "", "status": status}

    # ---- streams --------------------------------------------------------------------------

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """Chat completion chunks → Responses' stream events, as SSE."""
        stream = _EventStream(self)
        yield stream.event("response.created", response=self._response([], None, None))
        yield stream.event("response.in_progress", response=self._response([], None, None))
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                yield stream.event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
                return
            for text in stream.take(chunk):
                yield text
        for text in stream.close():
            yield text


class _EventStream:
    """The state of one Responses stream: the items opened so far and the event counter."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict] = []  # finished items, in order
        self.text: str | None = None  # the open message's text so far (None: no message open)
        self.logprobs: list[dict] = []
        self.calls: dict[int, dict] = {}  # chat tool_call index → its open function_call item
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    @property
    def index(self) -> int:
        """The output index of the item being written."""
        return len(self.output)

    def take(self, chunk: dict) -> list[str]:
        events = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"], (choice.get("logprobs") or {}).get("content") or [])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _text(self, delta: str, logprobs: list[dict]) -> list[str]:
        events = []
        if self.text is None:
            events += self._close_calls()
            self.text = ""
            item = self.shape._message_item("", None, status="in_progress")
            events.append(self.event("response.output_item.added", output_index=self.index, item=item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self.event("response.content_part.added", item_id=self.shape.message_id,
                                     output_index=self.index, content_index=0, part=part))
        self.text += delta
        self.logprobs += logprobs
        events.append(self.event("response.output_text.delta", item_id=self.shape.message_id, output_index=self.index,
                                 content_index=0, delta=delta, logprobs=logprobs))
        return events

    def _call(self, call: dict) -> list[str]:
        events = []
        item = self.calls.get(call["index"])
        if item is None:
            events += self._close_text()
            if self.calls:  # the previous call is complete once the next one starts
                events += self._close_calls()
            item = self.shape._call_item({"id": call["id"], "function": {**call["function"], "arguments": ""}},
                                         status="in_progress")
            self.calls[call["index"]] = item
            events.append(self.event("response.output_item.added", output_index=self.index, item=item))
        arguments = (call.get("function") or {}).get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.index, delta=arguments))
        return events

    def _close_text(self) -> list[str]:
        if self.text is None:
            return []
        text, self.text = self.text, None
        shape, index = self.shape, self.index
        item = shape._message_item(text, self.logprobs)
        part = item["content"][0]
        self.output.append(item)
        return [
            self.event("response.output_text.done", item_id=shape.message_id, output_index=index, content_index=0,
                       text=text, logprobs=self.logprobs),
            self.event("response.content_part.done", item_id=shape.message_id, output_index=index, content_index=0,
                       part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _close_calls(self) -> list[str]:
        events = []
        for item in self.calls.values():
            item["status"] = "completed"
            index = self.index
            self.output.append(item)
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        self.calls = {}
        return events

    def close(self) -> list[str]:
        events = self._close_text() + self._close_calls()
        response = self.shape._response(self.output, self.finish_reason or "stop", self.usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [self.event(kind, response=response)]


def responses_usage(usage: dict) -> dict:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
