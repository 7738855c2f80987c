"""Engine outputs → OpenAI response bodies and stream chunks (completions and chat completions).

Every body and the final stream chunk also carry `llmpipe_timing` (RequestMetrics.timing_breakdown).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from llmpipe.outputs import CompletionOutput, Logprob, RequestOutput
from llmpipe.tool_parsers import ToolCallStream, ToolParser


def usage(output: RequestOutput) -> dict:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(choice.token_ids) for choice in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((tid, lp) for tid, lp in entry.items() if lp.rank <= k), key=lambda item: item[1].rank)[:k]


@dataclass
class Format:
    """What completions and chat completions share; subclasses shape each choice."""

    request_id: str
    model: str
    top_logprobs: int | None  # None: no logprobs asked for
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:123" for each token
    token_bytes: Callable[[int], bytes] | None = None  # a token's own bytes (Tokenizer.token_bytes), for logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    object: ClassVar[str] = ""
    chunk_object: ClassVar[str] = ""

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, choices: list[dict]) -> dict:
        return self._envelope(self.chunk_object, choices)

    def _token(self, token_id: int, lp: Logprob) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return lp.decoded_token if lp.decoded_token is not None else ""

    def _logprobs(self, choice: CompletionOutput, start: int, end: int, text_offset: int) -> dict | None:
        if self.top_logprobs is None or choice.logprobs is None:
            return None
        return self.logprobs(choice.token_ids[start:end], choice.logprobs[start:end], text_offset)

    # Subclasses: full_choice, delta_choice, logprobs.


@dataclass
class CompletionFormat(Format):
    echo: bool = False  # each choice's text and logprobs start with its prompt's (server/request_batch.py)
    decode: Callable[[list[int]], str] | None = None  # token ids → text (special tokens kept), for echo
    object: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"

    def full_choice(self, choice: CompletionOutput) -> dict:
        return {
            "index": choice.index,
            "text": choice.text,
            "logprobs": self._logprobs(choice, 0, len(choice.token_ids), 0),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def delta_choice(self, choice: CompletionOutput, sent: StreamState, first: bool) -> dict:
        return {
            "index": choice.index,
            "text": choice.text[sent.chars :],
            "logprobs": self._logprobs(choice, sent.tokens, len(choice.token_ids), sent.chars),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob] | None], text_offset: int) -> dict:
        """An entry is None for an echoed prompt's first token (nothing before it): its logprobs are null."""
        tokens, offsets = [], []
        for tid, entry in zip(token_ids, entries):
            offsets.append(text_offset)
            tokens.append(self._token(tid, entry[tid]) if entry is not None else self._first_token(tid))
            text_offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [None if entry is None else entry[tid].logprob for tid, entry in zip(token_ids, entries)],
            "top_logprobs": [
                None if entry is None else {self._token(t, lp): lp.logprob for t, lp in _top(entry, self.top_logprobs)}
                for entry in entries
            ],
            "text_offset": offsets,
        }

    def _first_token(self, token_id: int) -> str:
        if self.tokens_as_ids or self.decode is None:
            return f"token_id:{token_id}"
        return self.decode([token_id])


@dataclass
class ChatFormat(Format):
    tool_parser: ToolParser | None = None  # reads tool calls out of the text; None: the text is all content
    object: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"

    def full_choice(self, choice: CompletionOutput) -> dict:
        message: dict = {"role": "assistant", "content": choice.text}
        finish_reason = choice.finish_reason
        if self.tool_parser is not None:
            message["content"], calls = self.tool_parser.extract(choice.text)
            if calls:
                message["tool_calls"] = [call.as_openai() for call in calls]
                finish_reason = _with_calls(finish_reason)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice, 0, len(choice.token_ids), 0),
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def delta_choice(self, choice: CompletionOutput, sent: StreamState, first: bool) -> dict | None:
        """The choice's next chunk; None when tool-call parsing holds back all that is new."""
        finish_reason = choice.finish_reason
        if self.tool_parser is None:
            delta = {"content": choice.text[sent.chars :]}
        else:
            if sent.tool_calls is None:
                sent.tool_calls = self.tool_parser.stream()
            delta = sent.tool_calls.extract_delta(choice.text, choice.finished)
            if sent.tool_calls.called:
                finish_reason = _with_calls(finish_reason)
            if not (delta or first or choice.finished or self.top_logprobs is not None):
                return None
        if first:
            delta = {"role": "assistant", **(delta or {"content": ""})}
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": self._logprobs(choice, sent.tokens, len(choice.token_ids), sent.chars),
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]], text_offset: int) -> dict:
        def item(token_id: int, lp: Logprob) -> dict:
            text = self._token(token_id, lp)
            raw = self.token_bytes(token_id) if self.token_bytes else text.encode("utf-8")
            return {"token": text, "logprob": lp.logprob, "bytes": list(raw)}

        return {
            "content": [
                {**item(tid, entry[tid]), "top_logprobs": [item(t, lp) for t, lp in _top(entry, self.top_logprobs)]}
                for tid, entry in zip(token_ids, entries)
            ]
        }


@dataclass
class StreamState:
    """How much of one choice the client has been sent."""

    chars: int = 0
    tokens: int = 0
    started: bool = False
    finished: bool = False
    tool_calls: ToolCallStream | None = None  # what of its tool calls was sent (when they are parsed)


def _with_calls(finish_reason: str | None) -> str | None:
    """A reply that ended naturally after making calls finished for them (OpenAI's "tool_calls")."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def stream_chunks(fmt: Format, output: RequestOutput, sent: list[StreamState]) -> list[dict]:
    """The chunks that bring the client up to date with `output` (one per choice that moved)."""
    choices = []
    for choice in output.outputs:
        state = sent[choice.index]
        # Tokens that add no text yet (half a UTF-8 character) only make a chunk for their logprobs.
        grew = len(choice.text) > state.chars or (fmt.top_logprobs is not None and len(choice.token_ids) > state.tokens)
        if state.finished or not (grew or choice.finished or not state.started):
            continue
        delta = fmt.delta_choice(choice, state, first=not state.started)
        state.chars, state.tokens = len(choice.text), len(choice.token_ids)
        state.started, state.finished = True, choice.finished
        if delta is not None:
            choices.append(delta)
    return [fmt.chunk([c]) for c in choices]
