"""Server-sent events: the JSON of one `data:` line, whatever text it carries."""

from __future__ import annotations

import json
import re
from typing import Any, AsyncIterator, Callable, Iterable, Protocol

# json.dumps escapes every C0 control (\n, \r, \x1c…) but leaves NEL, LINE SEPARATOR and PARAGRAPH
# SEPARATOR raw; clients that split lines as str.splitlines does (httpx's iter_lines among them) would
# cut an event in two there. Their escapes are the same JSON value.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)


def sse_lines(buffer: str, text: str) -> tuple[list[str], str]:
    """A client's side: the complete lines of buffer + text, and what is left of them. Lines end as
    server-sent events end them (CRLF, LF or CR), not as str.splitlines or httpx's iter_lines end them:
    those also split at NEL and U+2028 / U+2029, characters another server's events may hold raw."""
    *lines, rest = re.split(r"\r\n|\r|\n", buffer + text)
    return lines, rest


class ChunkTranslator(Protocol):
    """One stream's state as chat completion chunks become another API's events (Responses, Anthropic Messages)."""

    def take(self, chunk: dict) -> Iterable[str]: ...

    def close(self) -> Iterable[str]: ...


async def translated(chunks: AsyncIterator[dict], stream: ChunkTranslator,
                     on_error: Callable[[dict], str]) -> AsyncIterator[str]:
    """chunks through `stream`, as SSE; a chunk carrying an error (the engine failed the request, or the server is
    shutting down) ends it with on_error(error) instead of the stream's close."""
    async for chunk in chunks:
        if "error" in chunk:
            yield on_error(chunk["error"])
            return
        for text in stream.take(chunk):
            yield text
    for text in stream.close():
        yield text
