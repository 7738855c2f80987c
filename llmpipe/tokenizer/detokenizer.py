"""Streaming detokenization: token ids in, UTF-8-safe text deltas out, stop strings honoured."""

from __future__ import annotations

from collections.abc import Sequence

from llmpipe.tokenizer.stop_strings import StopStringMatcher
from llmpipe.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class _TextStream:
    """Decodes a growing id sequence piece by piece, never splitting a multi-byte character.

    Decoding only a short window (the last emitted piece's tokens, as context, plus the tokens not
    yet emitted) keeps each step O(token length); the context keeps decoders that treat the first
    token specially (a stripped leading space) consistent with a full decode. A window whose text
    ends in U+FFFD is an unfinished character and waits for more tokens. tokenizers' DecodeStream
    does the same but cannot hand back the unfinished tail when generation ends.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        self._context_len = 0  # tokens at the window's start that were already emitted
        self._context_text = ""

    def step(self, token_id: int) -> str:
        self._window.append(token_id)
        text = self._decode(self._window)
        if len(text) <= len(self._context_text) or text.endswith(_REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Whatever is left, unfinished characters included (as U+FFFD, like a full decode)."""
        text = self._decode(self._window)
        return self._advance(text) if len(text) > len(self._context_text) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, text: str) -> str:
        """Emit the window's text past its context; the emitted tokens become the next context."""
        delta = text[len(self._context_text) :]
        del self._window[: self._context_len]
        self._context_len = len(self._window)
        self._context_text = self._decode(self._window)
        return delta


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that are safe to stream.

    Deltas never contain a broken character; text that might begin a stop string is held back
    until it is resolved. Joined, all deltas plus finish() equal `tokenizer.decode(all_ids)`
    when no stop string matched.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._stream = _TextStream(tokenizer, skip_special_tokens)
        self._stops = StopStringMatcher(stop, include_stop_str_in_output)
        self._pieces: list[str] = []

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, once one has."""
        return self._stops.matched

    @property
    def text(self) -> str:
        """All text emitted so far (joined on each read: stream the deltas, read this at the end)."""
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """Take the next token; return the text delta that is safe to emit now ("" if held back)."""
        if self.stop_reason is not None:
            return ""
        return self._emit(self._stops.push(self._stream.step(token_id)))

    def finish(self) -> str:
        """End of generation for a reason other than a stop string: the held-back remainder."""
        if self.stop_reason is not None:
            return ""
        delta = self._stops.push(self._stream.flush())
        if self.stop_reason is None:
            delta += self._stops.flush()
        return self._emit(delta)

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta
