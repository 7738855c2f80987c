"""The grammar worker: a process that checks untrusted constraints for the front end, one at a time
(`python -m llmpipe.structured_output.worker STACK_BYTES`; sandbox.py starts and speaks to it).

Each request is a line of JSON, a GrammarKey; each reply a line {"problem": str | None, "lark":
str | None}. A compile runs on a thread with a large stack, under llguidance's limits, at a low
priority and with bounded memory: if it still crashes the process, only the request that sent it
fails (the sandbox starts another worker).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading

import llguidance
from llguidance.numpy import fill_next_token_bitmask
import numpy as np

from llmpipe.structured_output.grammar import CHECK_STACK_BYTES, COMPILE_NICE, GrammarKey, grammar_text, parser_limits

WORKER_MEMORY_BYTES = 4 * 2**30  # address space, stacks included
_EOS = 256  # the byte vocabulary: one token per byte, then EOS


class _Bytes:
    """A vocabulary of single bytes for llguidance: the probe's tokens, independent of any model."""

    tokens = [bytes([b]) for b in range(256)] + [b"\xff<eos>"]
    eos_token_id = _EOS
    bos_token_id = None
    special_token_ids = [_EOS]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


_VOCABULARY = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=_EOS + 1, eos_token=[_EOS])  # 1 ms


def inspect(key: GrammarKey) -> dict:
    """Compile the constraint and take its first steps over bytes: the problem that makes it
    unusable, if any, and its Lark text (for a grammar)."""
    try:
        text = grammar_text(key)
    except (ValueError, RecursionError) as err:
        return {"problem": str(err).strip() or type(err).__name__, "lark": None}
    matcher = llguidance.LLMatcher(_VOCABULARY, text, log_level=0, limits=parser_limits())
    problem = _first_steps(matcher)
    return {"problem": problem, "lark": text if key[0] == "grammar" else None}  # grammar_from gives Lark


def _first_steps(matcher: llguidance.LLMatcher) -> str | None:
    """Why the matcher cannot start: it does not compile; it allows nothing (a schema or grammar with
    no finite instance, such as a $ref to itself); or its first token already exhausts the parser (a
    rule that forces itself forever, such as `root ::= "a" root`)."""
    if matcher.is_error():
        return _first_line(matcher.get_error())
    mask = np.zeros((1, (_EOS + 32) // 32), dtype=np.int32)
    fill_next_token_bitmask(matcher, mask, 0)
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: _EOS + 1])
    if matcher.is_error() or not len(allowed):
        return "it matches no text (no finite output satisfies it)"
    if allowed[0] != _EOS and not matcher.consume_token(int(allowed[0])):
        return f"it can never end ({_first_line(matcher.get_error())})"
    return None


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "it does not compile"


def _on_big_stack(key: GrammarKey) -> dict:
    reply: dict = {}
    thread = threading.Thread(target=lambda: reply.update(inspect(key)), name="grammar-check")  # traceback: stderr
    thread.start()
    thread.join()
    return reply or {"problem": "the check failed", "lark": None}


def main() -> None:
    os.nice(COMPILE_NICE)
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    threading.stack_size(int(sys.argv[1]) if len(sys.argv) > 1 else CHECK_STACK_BYTES)
    out = sys.stdout
    for line in sys.stdin:
        out.write(json.dumps(_on_big_stack(tuple(json.loads(line)))) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
