"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as a shape over
chat completions, as llama-server and Ollama serve it.

A Messages body becomes a chat completions body, as a Responses body does (server/responses.py), so
one code path templates, samples and parses tool calls for every route:
  system (a string or text blocks)     → a system message first
  a user turn's text blocks            → a user message; each tool_result block → a tool message
                                         (tool_use_id → tool_call_id; is_error: its text after "Error: ")
  an assistant turn's text blocks      → its content; its tool_use blocks → its tool_calls (input as JSON text)
  tools (name, description, input_schema) → function tools
  tool_choice auto / any / tool / none → "auto" / "required" / the named function / "none"
                                         (disable_parallel_tool_use → parallel_tool_calls: false)
  max_tokens, temperature, top_p, top_k → as they are; stop_sequences → stop; metadata is ignored.
The chat reply, or its stream of chunks, is then reshaped into a `message` (text and tool_use blocks;
finish_reason stop / length / tool_calls → stop_reason end_turn or stop_sequence / max_tokens /
tool_use), or into Anthropic's stream events (`message_start`, `content_block_start`,
`content_block_delta` with `text_delta` / `input_json_delta`, `content_block_stop`, `message_delta`,
`message_stop`). count_tokens counts the prompt the same conversion templates.

Errors have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with the status the
OpenAI routes give the same failure (server/errors.py).
"""

from __future__ import annotations

import json
import uuid
from itertools import groupby
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llmpipe.errors import InvalidRequestError
from llmpipe.server.anthropic_protocol import CountTokensRequest, MessagesRequest, TextBlock, ToolChoice, ToolResultBlock
from llmpipe.server.input_processor import InputProcessor, parse_body, validate_body
from llmpipe.server.protocol import ChatCompletionRequest, FunctionTool
from llmpipe.server.responses import chat_error
from llmpipe.server.sse import sse_json, translated

PATH = "/v1/messages"  # and /v1/messages/count_tokens
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # chat finish_reason → stop_reason
CHAT_PARAMS = {"messages": "messages", "stop": "stop_sequences"}  # chat field → the Messages field
TOOL_ERROR = "Error: "  # what a tool_result's text follows when is_error is set


# ---- requests ------------------------------------------------------------------------------

def messages_request(inputs: InputProcessor, raw: bytes) -> tuple:
    """A Messages body, run as the chat completion it amounts to: (chat body, requests, format, MessageShape)."""
    body = parse_body(MessagesRequest, raw)
    try:
        chat, requests, fmt = inputs.chat(validate_body(ChatCompletionRequest, chat_body(body)))
    except InvalidRequestError as err:
        raise chat_error(err, CHAT_PARAMS) from None
    return chat, requests, fmt, MessageShape(chat.model or inputs.model_name, len(requests[0][0]["prompt_token_ids"]))


def count_tokens(inputs: InputProcessor, raw: bytes) -> JSONResponse:
    """`{"input_tokens": N}`: the prompt the same body would be templated into."""
    body = parse_body(CountTokensRequest, raw)
    try:
        chat = validate_body(ChatCompletionRequest, prompt_body(body))
        inputs.check_model(chat.model, adapters=True)
        prompt = inputs.chat_prompt(chat, chat.add_special_tokens, counted=True)
    except InvalidRequestError as err:
        raise chat_error(err, CHAT_PARAMS) from None
    return JSONResponse({"input_tokens": len(prompt["prompt_token_ids"])})


def prompt_body(body: CountTokensRequest) -> dict:
    """The chat completions fields that make the prompt: the messages and the tools."""
    chat: dict[str, Any] = {"messages": chat_messages(body)}
    if body.model is not None:
        chat["model"] = body.model
    if body.tools:
        chat["tools"] = [FunctionTool(type="function", name=tool.name, description=tool.description,
                                      parameters=tool.input_schema, strict=tool.strict).as_chat_tool()
                         for tool in body.tools]
    if body.tool_choice is not None:
        chat.update(chat_tool_choice(body.tool_choice))
    return chat


def chat_body(body: MessagesRequest) -> dict:
    """The same request as a chat completions body."""
    chat = {**prompt_body(body), "max_tokens": body.max_tokens, "stream": body.stream}
    optional = {"stop": body.stop_sequences or None, "temperature": body.temperature, "top_p": body.top_p,
                "top_k": body.top_k}
    chat.update({k: v for k, v in optional.items() if v is not None})
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    return chat


def chat_messages(body: CountTokensRequest) -> list[dict]:
    messages = [{"role": "system", "content": _parts(body.system)}] if body.system else []
    for message in body.messages:
        if message.role == "user":
            messages += _user_turns(message.content)
        else:
            messages.append(_assistant_turn(message.content))
    return messages


def chat_tool_choice(choice: ToolChoice) -> dict:
    if choice.type == "tool":
        fields: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": choice.name}}}
    else:
        fields = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[choice.type]}
    if getattr(choice, "disable_parallel_tool_use", None):
        fields["parallel_tool_calls"] = False
    return fields


def _parts(content: str | list | None) -> list[dict]:
    """Text content as chat text parts (which the chat route joins); blocks of other types are left out."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": block.text} for block in content if isinstance(block, TextBlock)]


def _user_turns(content: str | list) -> list[dict]:
    """A user turn as chat messages, in order: each tool_result a tool message, the text between them user messages."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    turns = []
    for results, blocks in groupby(content, key=lambda block: isinstance(block, ToolResultBlock)):
        if results:
            turns += [_tool_message(block) for block in blocks]
        else:
            turns.append({"role": "user", "content": _parts(list(blocks))})
    return turns or [{"role": "user", "content": ""}]


def _tool_message(block: ToolResultBlock) -> dict:
    content = _parts(block.content)
    if block.is_error:
        content = [{"type": "text", "text": TOOL_ERROR}, *content]
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _assistant_turn(content: str | list) -> dict:
    blocks = [] if isinstance(content, str) else content
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
             for block in blocks if block.type == "tool_use"]
    turn: dict[str, Any] = {"role": "assistant", "content": _parts(content) or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


# ---- replies -------------------------------------------------------------------------------

class MessageShape:
    """Chat completion replies and chunks → one `message` and its stream events."""

    def __init__(self, model: str, input_tokens: int) -> None:
        self.model = model
        self.input_tokens = input_tokens
        self.id = f"msg_{uuid.uuid4().hex}"

    def body(self, chat: dict) -> dict:
        choice = chat["choices"][0]
        message = choice["message"]
        content = [{"type": "text", "text": message["content"]}] if message.get("content") else []
        content += [_tool_use(call["id"], call["function"]["name"], _input(call["function"]["arguments"]))
                    for call in message.get("tool_calls") or ()]
        usage = chat["usage"]
        return self.message(content, stop_of(choice["finish_reason"], choice.get("stop_reason")),
                            {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]})

    def message(self, content: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """Chat completion chunks → Anthropic's stream events, as SSE."""
        yield event("message_start", message=self.message([], (None, None), {"input_tokens": self.input_tokens,
                                                                             "output_tokens": 0}))
        async for text in translated(chunks, _EventStream(), lambda error: event("error", error=stream_error(error))):
            yield text


class _EventStream:
    """One stream's state: the content blocks opened so far, and how the reply ended."""

    def __init__(self) -> None:
        self.blocks = 0  # content blocks started
        self.open: str | int | None = None  # the open block: "text", a chat tool_call index, or None
        self.calls: dict[int, int] = {}  # chat tool_call index → its block's index
        self.finish: tuple[str | None, str | int | None] = (None, None)  # finish_reason, stop_reason
        self.output_tokens = 0

    def take(self, chunk: dict) -> list[str]:
        events = []
        if chunk.get("usage"):
            self.output_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open != "text":
                    events += self._start("text", {"type": "text", "text": ""})
                events.append(event("content_block_delta", index=self.blocks - 1,
                                    delta={"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return events

    def _call(self, call: dict) -> list[str]:
        events = []
        function = call.get("function") or {}
        if call["index"] not in self.calls:
            events += self._start(call["index"], _tool_use(call["id"], function["name"], {}))
            self.calls[call["index"]] = self.blocks - 1
        if function.get("arguments"):
            events.append(event("content_block_delta", index=self.calls[call["index"]],
                                delta={"type": "input_json_delta", "partial_json": function["arguments"]}))
        return events

    def _start(self, key: str | int, block: dict) -> list[str]:
        events = self._stop()
        self.open = key
        events.append(event("content_block_start", index=self.blocks, content_block=block))
        self.blocks += 1
        return events

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.blocks - 1)]

    def close(self) -> list[str]:
        stop_reason, stop_sequence = stop_of(*self.finish)
        return self._stop() + [
            event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                  usage={"output_tokens": self.output_tokens}),
            event("message_stop"),
        ]


def event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {sse_json({'type': kind, **fields})}\n\n"


def stop_of(finish_reason: str | None, stop_reason: str | int | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and vLLM's stop_reason (the stop
    string it matched, a stop token id, or None)."""
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def _tool_use(call_id: str, name: str, tool_input: dict) -> dict:
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input}


def _input(arguments: str) -> dict:
    """A parsed call's arguments (JSON text) as tool_use's input object."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {}


# ---- errors --------------------------------------------------------------------------------

def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def stream_error(error: dict) -> dict:
    """A chat stream's error (OpenAI's shape: server/errors.py) as Anthropic's `error` event's."""
    if error.get("code") == "service_unavailable":
        status = 503
    else:
        status = 400 if error.get("type") == "invalid_request_error" else 500
    return error_body(status, error.get("message") or "")["error"]


async def anthropic_errors(request: Request, reply: Awaitable[Response]) -> Response:
    """`reply`, or the error it raised as the app's own handlers answer it (server/errors.py: the same
    status and message as on the OpenAI routes, logged the same way) in Anthropic's shape."""
    try:
        return await reply
    except Exception as err:
        handlers = request.app.exception_handlers
        handler = next(handlers[kind] for kind in type(err).__mro__ if kind in handlers)
        answer = await handler(request, err)
        return error_response(answer.status_code, json.loads(answer.body)["error"]["message"])
