"""Byte-level BPE (GGUF `tokenizer.ggml.model = "gpt2"`): GPT-2's byte alphabet, merges, split regex."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cache

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

logger = logging.getLogger(__name__)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF `tokenizer.ggml.pre` → the regex that splits text before BPE, as transformers maps them.
# Kinds not listed get GPT-2's own split (the ByteLevel pre-tokenizer's built-in regex).
SPLIT_REGEX_BY_PRE = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# Kinds whose split GPT-2's regex reproduces exactly on their vocabulary, so no warning is due.
# (llama.cpp also isolates digits for "smollm", but SmolLM2's merges never join a digit to anything.)
GPT2_SPLIT_PRES = frozenset({"default", "gpt-2", "gpt2", "smollm"})


@cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes as themselves, others shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in spelling)
    spelling.update((byte, chr(256 + offset)) for offset, byte in enumerate(shifted))
    return spelling


@cache
def char_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in byte_to_char().items()}


def token_bytes(token: str) -> bytes:
    """The bytes a byte-level vocabulary entry stands for (its characters spell one byte each)."""
    spelling = char_to_byte()
    return b"".join(bytes([spelling[c]]) if c in spelling else c.encode("utf-8") for c in token)


@cache
def _alphabet() -> frozenset[str]:
    return frozenset(byte_to_char().values())


def byte_level_spelling(token: str) -> str:
    """The token as a byte-level vocabulary spells it; text already in the byte alphabet is kept."""
    if _alphabet().issuperset(token):
        return token
    spelling = byte_to_char()
    return "".join(spelling[byte] for byte in token.encode("utf-8"))


def build_byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str | None) -> tokenizers.Tokenizer:
    """A GPT-2 style tokenizer: byte-alphabet vocabulary, ranked merges, the `pre` kind's split regex."""
    # Later duplicates win, as in a dict built in file order (transformers does the same).
    if _alphabet().issuperset("".join(tokens)):  # as GGUF files spell them: one check, not one per token
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        vocab = {byte_level_spelling(token): index for index, token in enumerate(tokens)}
    ranked = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=ranked, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    kind = pre or "default"
    split = SPLIT_REGEX_BY_PRE.get(kind)
    if split is None:
        if kind not in GPT2_SPLIT_PRES:
            logger.warning("GGUF pre-tokenizer %r is not known; splitting text with GPT-2's regex", kind)
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
