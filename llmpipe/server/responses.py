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

import time
import uuid
from typing import Any, AsyncIterator


from llmpipe.errors import InvalidRequestError
from llmpipe.server.protocol import ResponsesRequest
from llmpipe.server.sse import sse_json, translated

CHAT_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "messages": "input",
               "response_format": "text.format", "top_logprobs": "top_logprobs"}


def chat_error(err: InvalidRequestError, params: dict[str, str] = CHAT_PARAMS) -> InvalidRequestError:
    """A chat completions error, naming the field it came from (`params`: chat field → the field of the
    API called, the Responses API's unless told)."""
    param = err.param or ""
    head, _, rest = param.partition(".")
    field = head.split("[")[0]
    name = params.get(field)
    if name is None:
        return err
    if field != head:  # messages[i]: i counts chat messages, not input items (instructions, merged calls)
        rest = ""
    message = str(err).replace(head if field != head else field, name, 1)
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
        error = lambda e: stream.event("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))  # noqa: E731
        async for text in translated(chunks, stream, error):
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
        return f"event: {kind}\ndata: {sse_json(data)}\n\n"

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
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
