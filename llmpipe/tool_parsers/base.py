"""What every tool-call parser shares: the calls it returns, and the stream that turns a growing
text into OpenAI's chat-completion deltas."""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field

from llmpipe.tool_parsers.json_calls import CallSoFar, scan_memo


@dataclass(frozen=True)
class ToolCall:
    """One finished call, as OpenAI returns it: `arguments` is JSON text."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Reading:
    """A text read by a parser: its content (what is certain of it, while the text grows) and the calls."""

    content: str | None
    calls: list[CallSoFar] = field(default_factory=list)


class ToolParser:
    """Reads a model's tool calls out of its output text. Subclasses implement `read`."""

    name = ""
    reads_special_tokens = False  # its markers are special tokens, so decoding must keep them
    writes_prompts = False  # whether the format documents a prompt for tools, calls and results (below)

    def read(self, text: str, final: bool) -> Reading:
        """The content and calls of `text`. `final`: the text is complete, so a call that is not
        well formed makes it all content. Otherwise the text may still grow: the content returned
        is only what cannot turn out to be part of a call, and the last call may be incomplete;
        what is returned for a text is a prefix of what is returned for any longer one."""
        raise NotImplementedError

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def tools_prompt(self, tools: list[dict]) -> str:
        """The format's documented system prompt for `tools` (OpenAI's), for a chat template that renders none."""
        raise NotImplementedError

    def calls_text(self, calls: list[dict]) -> str:
        """An assistant turn's `calls` (OpenAI's, arguments as JSON text) as the format has the model write them."""
        raise NotImplementedError

    def result_text(self, content: str) -> str:
        """A tool message's content as the format hands a result back."""
        return content

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a complete output; content is None when there is only calls."""
        reading = self.read(text, final=True)
        return reading.content, [ToolCall(self.new_id(), call.name, call.arguments) for call in reading.calls]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def parse_tool_calls(text: str, parser: ToolParser) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's complete output, read by `parser`."""
    return parser.extract(text)


def certain_prefix(text: str, marker: str) -> str:
    """`text` less any ending that may be the start of `marker`, and less trailing space (which is
    dropped if a call follows)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            text = text[:-size]
            break
    return text.rstrip()


def random_alphanumeric(size: int) -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(size))


@dataclass
class _SentCall:
    id: str
    arguments: int = 0  # characters of the arguments sent


class ToolCallStream:
    """One choice's stream: each call of `extract_delta` gives what the client has not seen yet."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content_sent = 0
        self.calls: list[_SentCall] = []
        self.scans: dict[int, tuple[int, int]] = {}  # json_calls.scan_memo of this stream's text

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def extract_delta(self, text: str, finished: bool) -> dict:
        """OpenAI delta fields for the text so far (the whole text, not the new part): `content`
        and/or `tool_calls` ([{index, id, type, function: {name, arguments}}], the id, type and name
        only on a call's first delta), or {} when nothing new is certain."""
        token = scan_memo.set(self.scans)
        try:
            reading = self.parser.read(text, final=finished)
            if finished and self.calls and not reading.calls:
                # The ending turned out malformed, but calls were already sent: a stream cannot take
                # them back, so it ends as it went (not with the whole text again as content).
                reading = self.parser.read(text, final=False)
        finally:
            scan_memo.reset(token)
        delta: dict = {}
        content = reading.content or ""
        if len(content) > self.content_sent:
            delta["content"] = content[self.content_sent :]
            self.content_sent = len(content)
        tool_calls = [d for index, call in enumerate(reading.calls) if (d := self._call_delta(index, call))]
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return delta

    def _call_delta(self, index: int, call: CallSoFar) -> dict | None:
        if call.name is None:
            return None
        if index == len(self.calls):
            self.calls.append(_SentCall(self.parser.new_id()))
            sent = self.calls[index]
            sent.arguments = len(call.arguments)
            function = {"name": call.name, "arguments": call.arguments}
            return {"index": index, "id": sent.id, "type": "function", "function": function}
        sent = self.calls[index]
        if len(call.arguments) <= sent.arguments:
            return None
        new = call.arguments[sent.arguments :]
        sent.arguments = len(call.arguments)
        return {"index": index, "function": {"arguments": new}}
