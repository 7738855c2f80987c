"""A StructuredOutputsParams as llguidance grammar text, and the bounds every constraint is held to
before anything native compiles it.

A constraint is untrusted input that a native compiler recurses over: its check at admission runs in
a worker process (structured_output/sandbox.py), so a constraint that overflows the compiler's stack,
or runs past the deadline, fails its own request and nothing else."""

from __future__ import annotations

import json
import re

import llguidance

from llmpipe.sampling_params import StructuredOutputsParams

# What a compiled grammar is cached by: (kind, its spec as text, flexible whitespace).
GrammarKey = tuple[str, str, bool]
_ANY_OBJECT = '{"type": "object"}'
# Flexible JSON whitespace as llama.cpp's JSON grammars bound it: one space, or a newline and at most 20
# spaces or tabs of indent. Unbounded whitespace lets a weak model spend every token on it.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"
_FORMATS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}  # → llguidance.grammar_from's format; "grammar": GBNF, EBNF or Lark

# Bounds checked in Python before a constraint reaches a compiler. Generous for real schemas and
# grammars (tool schemas nest < 30 deep; llama.cpp's GBNF files have < 300 rules); what lies past
# them only costs time and stack. GBNF's conversion to Lark is quadratic in its rules (5,000 rules:
# 1.6 s), and a compile's stack grows with the depth of $ref chains and rule chains.
MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_GRAMMAR_RULES = 5_000
MAX_SCHEMA_DEPTH = 128  # nesting of a JSON schema, counted through its $refs
# Below llguidance's own ceilings (500,000 symbols; u16 symbol ids, whose overflow is a panic).
MAX_GRAMMAR_SYMBOLS = 60_000
# Where a constraint compiles: on a thread this large (a compile recurses in native code; the engine
# core's compile threads get twice it, a margin over the front end's check) and this nice (the
# engine's own threads come first).
CHECK_STACK_BYTES = 256 * 2**20
COMPILE_NICE = 10
_RULE = re.compile(r"^[ \t]*[A-Za-z_?!][\w.-]*[ \t]*(?:::=|:(?!:))", re.MULTILINE)


def parser_limits() -> llguidance.LLParserLimits:
    """The limits every compile and matcher runs under (one definition, front end and core alike)."""
    return llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, verbose_errors=False)


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


def check_bounds(key: GrammarKey) -> None:
    """ValueError when the constraint is past a bound (size, rule count, schema depth)."""
    kind, text, _ = key
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{len(text):,} characters, over the limit of {MAX_CONSTRAINT_CHARS:,}")
    if kind == "grammar":
        rules = len(_RULE.findall(text))
        if rules > MAX_GRAMMAR_RULES:
            raise ValueError(f"{rules:,} rules, over the limit of {MAX_GRAMMAR_RULES:,}")
    elif kind == "json":
        depth = schema_depth(json.loads(text), MAX_SCHEMA_DEPTH)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"nested more than {MAX_SCHEMA_DEPTH} deep (counting through $ref)")


def schema_depth(schema: object, limit: int) -> int:
    """How deep a JSON schema nests, following local $refs ("#/...") into what they point at; a $ref
    back into its own chain (a recursive schema) adds nothing. Stops counting past `limit`."""
    memo: dict[str, int] = {}

    def depth(node: object, chain: tuple[str, ...]) -> int:
        if len(chain) > limit + 1:  # the chain starts with the root, "#"
            return limit + 1
        if isinstance(node, list):
            return max((depth(item, chain + ("",)) for item in node), default=0) + 1
        if not isinstance(node, dict):
            return 0
        deepest = max((depth(value, chain + ("",)) for value in node.values()), default=0) + 1
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in chain:
            if ref not in memo:
                memo[ref] = depth(_resolve(schema, ref), chain + (ref,))
            deepest = max(deepest, memo[ref])  # the $ref's own level counted above
        return deepest

    return depth(schema, ("#",))


def _resolve(schema: object, ref: str) -> object:
    """What a local JSON pointer ("#/$defs/a") names; None if nothing."""
    node = schema
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def grammar_text(key: GrammarKey) -> str:
    """llguidance's grammar for the key; ValueError if it does not build or is past a bound."""
    check_bounds(key)
    kind, text, flexible = key
    if _FORMATS[kind] != "json_schema":
        return llguidance.grammar_from(_FORMATS[kind], text)
    schema = json.loads(text)  # json.JSONDecodeError is a ValueError
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
    whitespace = {"whitespace_pattern": JSON_WHITESPACE} if flexible else {"whitespace_flexible": False}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=whitespace)
