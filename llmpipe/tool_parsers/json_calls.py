"""Reading tool calls written as JSON objects, `{"name": ..., "arguments": {...}}`, from text that may
still be growing (a stream) or is complete.

A call's `arguments` is the JSON text the model wrote for them, sliced from the output, so a stream
that sends the slice as it grows reassembles to exactly what the complete text gives.
"""

from __future__ import annotations

import json
import re
from contextvars import ContextVar
from dataclasses import dataclass

# The shape models are taught: the name first, then the arguments (Llama 3 calls them "parameters").
_NAME_THEN_ARGUMENTS = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_ARGUMENT_KEYS = ("arguments", "parameters")
# JSON's structural tokens: a whole string, an unterminated one (a lone quote), a bracket.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|"|[{}\[\]]')
_SPACE = re.compile(r"\s*")


@dataclass
class CallSoFar:
    """One tool call as far as the text shows it."""

    name: str | None  # None until the name is complete
    arguments: str  # the arguments' JSON text, as much of it as is certain
    end: int | None = None  # where the call's JSON ends in the text; None while incomplete


def skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


# A stream re-reads its growing text at every step; each open value's scan resumes where the last
# one stopped (text only grows, so what was scanned stays as it was), which keeps a long call linear.
# ToolCallStream sets it for the duration of one read: {value start: (position reached, depth there)}.
scan_memo: ContextVar[dict[int, tuple[int, int]] | None] = ContextVar("scan_memo", default=None)


def value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at `start` closes, or None if it is still open."""
    memo = scan_memo.get()
    pos, depth = memo.get(start, (start, 0)) if memo is not None else (start, 0)
    if pos > len(text):  # the text was cut short of what was scanned (a parser's slice): start over
        pos, depth = start, 0
    for match in _JSON_TOKENS.finditer(text, pos):
        token = match.group()
        if token == '"':  # an unterminated string: resume at its quote
            pos = match.start()
            break
        pos = match.end()
        if token[0] == '"':
            continue
        depth += 1 if token in "{[" else -1
        if depth == 0:
            return match.end()
    else:
        pos = len(text)
    if memo is not None:
        memo[start] = (pos, depth)
    return None


def read_call(text: str, start: int) -> CallSoFar | None:
    """The call whose JSON object starts at `start` (CallSoFar.end None: not complete yet), or None
    when the text there cannot be one."""
    if start >= len(text):
        return CallSoFar(None, "")
    if text[start] != "{":
        return None
    head = _NAME_THEN_ARGUMENTS.match(text, start)
    if head is None:
        return _whole_object(text, start)
    name = json_string(head.group(1))
    if name is None:  # not a name JSON can spell (a stray escape): no call
        return None
    begin = head.end()
    if begin == len(text):
        return CallSoFar(name, "")
    if text[begin] not in "{[":  # a scalar: only complete ones count
        return _whole_object(text, start, name)
    end = value_end(text, begin)
    if end is None:
        return CallSoFar(name, text[begin:])
    arguments = text[begin:end]
    if not is_json(arguments):
        return None
    close = skip_space(text, end)
    if close == len(text):
        return CallSoFar(name, arguments)
    if text[close] == "}":
        return CallSoFar(name, arguments, close + 1)
    whole = _whole_object(text, start, name)  # more keys after the arguments
    return whole if whole is None or whole.end is None else CallSoFar(name, arguments, whole.end)


def _whole_object(text: str, start: int, known_name: str | None = None) -> CallSoFar | None:
    """A call read only once its object is complete (keys in another order, scalar arguments)."""
    if value_end(text, start) is None:  # still open (checked first: a scan resumes, a decode does not)
        return CallSoFar(known_name, "")
    try:
        obj, end = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return None if value_end(text, start) is not None else CallSoFar(known_name, "")
    key = next((k for k in _ARGUMENT_KEYS if k in obj), None) if isinstance(obj, dict) else None
    if key is None or not isinstance(obj.get("name"), str):
        return None
    return CallSoFar(obj["name"], json.dumps(obj[key], ensure_ascii=False), end)


def read_call_array(text: str, start: int) -> tuple[list[CallSoFar], int | None] | None:
    """`[call, call, ...]` from `start` (just after the `[`): the calls so far and where the array
    ends (None while open), or None when the text is not such an array."""
    calls: list[CallSoFar] = []
    pos = skip_space(text, start)
    if pos < len(text) and text[pos] == "]":
        return calls, pos + 1
    while True:
        call = read_call(text, pos)
        if call is None:
            return None
        calls.append(call)
        if call.end is None:
            return calls, None
        pos = skip_space(text, call.end)
        if pos == len(text):
            return calls, None
        if text[pos] == "]":
            return calls, pos + 1
        if text[pos] != ",":
            return None
        pos = skip_space(text, pos + 1)


def json_string(body: str) -> str | None:
    """The string whose JSON text (without quotes) is `body`; None when that is not valid JSON or
    holds a lone surrogate."""
    try:
        value = json.loads(f'"{body}"')
        value.encode("utf-8")
    except (json.JSONDecodeError, UnicodeEncodeError):
        return None
    return value


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
