"""A StructuredOutputsParams as llguidance grammar text, and its check at admission (a 400 naming
the field, before the request reaches the engine core)."""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance

from llmpipe.errors import InvalidRequestError
from llmpipe.sampling_params import StructuredOutputsParams

# What a compiled grammar is cached by: (kind, its spec as text, flexible whitespace).
GrammarKey = tuple[str, str, bool]
_ANY_OBJECT = '{"type": "object"}'
# Flexible JSON whitespace as llama.cpp's JSON grammars bound it: one space, or a newline and at most 20
# spaces or tabs of indent. Unbounded whitespace lets a weak model spend every token on it.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"
_FORMATS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}  # → llguidance.grammar_from's format; "grammar": GBNF, EBNF or Lark


def grammar_key(spec: StructuredOutputsParams) -> GrammarKey:
    if spec.json_object:
        return "json_object", _ANY_OBJECT, not spec.disable_any_whitespace
    if spec.json is not None:
        # Keys left unsorted: their order is the output's.
        text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return "json", text, not spec.disable_any_whitespace
    if spec.choice is not None:
        return "choice", json.dumps(spec.choice), False
    kind = "regex" if spec.regex is not None else "grammar"
    return kind, getattr(spec, kind), False


def grammar_text(key: GrammarKey) -> str:
    """llguidance's grammar for the key; ValueError if it does not build."""
    kind, text, flexible = key
    if _FORMATS[kind] != "json_schema":
        return llguidance.grammar_from(_FORMATS[kind], text)
    schema = json.loads(text)  # json.JSONDecodeError is a ValueError
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
    whitespace = {"whitespace_pattern": JSON_WHITESPACE} if flexible else {"whitespace_flexible": False}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=whitespace)


@lru_cache(maxsize=256)
def _problem(key: GrammarKey) -> str | None:
    """Why the key's grammar does not compile, or None."""
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(key))
    except ValueError as err:
        return str(err)
    return messages[0].strip() if is_error else None


def check_structured_outputs(spec: StructuredOutputsParams | None, field: str | None = None) -> None:
    """Whether the constraint compiles (a bad regex, an invalid or unsatisfiable schema, a grammar
    that does not parse): InvalidRequestError naming `field` (default `structured_outputs.<kind>`) if not."""
    if spec is None:
        return
    key = grammar_key(spec)
    problem = _problem(key)
    if problem is not None:
        field = field or f"structured_outputs.{key[0]}"
        raise InvalidRequestError(f"{field}: invalid {_WHAT[key[0]]}: {problem}", param=field)


_WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}
