"""Building a Tokenizer from a GGUF file's `tokenizer.*` metadata (llama.cpp's key names).

A GGUF carries no tokenizer.json: the vocabulary, merges, token kinds and special ids are metadata.
Each `tokenizer.ggml.model` kind has a builder for the BPE core; what sits on top of it (tokens
matched whole, BOS/EOS, chat template) is the same for every kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf
import tokenizers

from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.tokenizer.byte_level import build_byte_level_bpe
from llmpipe.tokenizer.default_templates import default_chat_template
from llmpipe.tokenizer.sentencepiece import build_sentencepiece_bpe
from llmpipe.tokenizer.special_tokens import add_whole_tokens, bos_eos_processor
from llmpipe.tokenizer.tokenizer import Tokenizer

# llama.cpp token kinds (`tokenizer.ggml.token_type`).
CONTROL = 3  # special: <|im_start|>, <|endoftext|>
USER_DEFINED = 4  # matched whole but plain text: <think>

# Template variable name → GGUF key of its id; the four transformers reads from a GGUF.
_NAMED_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def metadata(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def required_metadata(reader: gguf.GGUFReader, key: str) -> Any:
    value = metadata(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF file has no {key!r}; it does not describe a complete tokenizer")
    return value


def _byte_level(reader: gguf.GGUFReader) -> tokenizers.Tokenizer:
    return build_byte_level_bpe(
        required_metadata(reader, "tokenizer.ggml.tokens"),
        required_metadata(reader, "tokenizer.ggml.merges"),
        metadata(reader, "tokenizer.ggml.pre"),
    )


def _sentencepiece(reader: gguf.GGUFReader) -> tokenizers.Tokenizer:
    tokens = required_metadata(reader, "tokenizer.ggml.tokens")
    unk = metadata(reader, "tokenizer.ggml.unknown_token_id")
    return build_sentencepiece_bpe(
        tokens,
        required_metadata(reader, "tokenizer.ggml.scores"),
        unk_token=tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
        architecture=metadata(reader, "general.architecture"),
        add_space_prefix=metadata(reader, "tokenizer.ggml.add_space_prefix", True),
    )


# `tokenizer.ggml.model` → builder of the BPE core.
BUILDERS: dict[str, Callable[[gguf.GGUFReader], tokenizers.Tokenizer]] = {"gpt2": _byte_level, "llama": _sentencepiece}
# Kinds whose files may omit add_bos_token because llama.cpp (and transformers) then add BOS.
BOS_BY_DEFAULT = frozenset({"llama"})


def load_gguf_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    kind = required_metadata(reader, "tokenizer.ggml.model")
    if kind not in BUILDERS:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: {', '.join(sorted(BUILDERS))})"
        )
    backend = BUILDERS[kind](reader)
    tokens = required_metadata(reader, "tokenizer.ggml.tokens")
    named_ids = _named_token_ids(reader, len(tokens))
    named = {name: tokens[index] for name, index in named_ids.items()}
    kinds = metadata(reader, "tokenizer.ggml.token_type", [])
    add_whole_tokens(backend, [t for t, k in zip(tokens, kinds) if k == CONTROL] + [*named.values()], special=True)
    add_whole_tokens(backend, [t for t, k in zip(tokens, kinds) if k == USER_DEFINED], special=False)
    bos_default = kind in BOS_BY_DEFAULT
    bos = _if_added(reader, "tokenizer.ggml.add_bos_token", named.get("bos_token"), named_ids.get("bos_token"), bos_default)
    eos = _if_added(reader, "tokenizer.ggml.add_eos_token", named.get("eos_token"), named_ids.get("eos_token"))
    backend.post_processor = bos_eos_processor(bos, eos)
    return Tokenizer(
        backend,
        bos_token_id=named_ids.get("bos_token"),
        eos_token_id=named_ids.get("eos_token"),
        special_tokens=named,
        chat_template=metadata(reader, "tokenizer.chat_template")
        or default_chat_template(metadata(reader, "general.architecture")),
    )


def _named_token_ids(reader: gguf.GGUFReader, vocab_size: int) -> dict[str, int]:
    ids = {name: metadata(reader, key) for name, key in _NAMED_TOKEN_KEYS.items()}
    for name, index in ids.items():
        if index is not None and not 0 <= index < vocab_size:
            raise ModelLoadError(f"GGUF {name} id {index} is outside the vocabulary of {vocab_size} tokens")
    return {name: int(index) for name, index in ids.items() if index is not None}


def _if_added(
    reader: gguf.GGUFReader, flag: str, text: str | None, index: int | None, default: bool = False
) -> tuple[str, int] | None:
    """(text, id) of a BOS/EOS token the file says (or its kind implies) every encode adds, else None."""
    if text is None or index is None or not metadata(reader, flag, default):
        return None
    return text, index
