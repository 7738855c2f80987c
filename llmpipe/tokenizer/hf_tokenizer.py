"""Building a Tokenizer from a Hugging Face directory: tokenizer.json, tokenizer_config.json, chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from llmpipe.errors import ModelLoadError
from llmpipe.files import read_json
from llmpipe.tokenizer.special_tokens import NAMED_TOKENS, add_whole_tokens
from llmpipe.tokenizer.tokenizer import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # transformers v5 saves the template here, not in the config


def load_hf_tokenizer(path: Path) -> Tokenizer:
    """tokenizer.json decides encoding, BOS/EOS included: transformers ignores the config's
    add_bos_token/add_eos_token whenever tokenizer.json exists, and so does this."""
    backend = _read_backend(path / TOKENIZER_FILE)
    config = _read_config(path / CONFIG_FILE)
    named = {name: text for name in NAMED_TOKENS if (text := _token_text(config.get(name))) is not None}
    add_whole_tokens(backend, named.values(), special=True)
    bos, eos = named.get("bos_token"), named.get("eos_token")
    return Tokenizer(
        backend,
        bos_token_id=backend.token_to_id(bos) if bos is not None else None,
        eos_token_id=backend.token_to_id(eos) if eos is not None else None,
        special_tokens=named,
        chat_template=_chat_template(path, config),
    )


def _read_backend(file: Path) -> tokenizers.Tokenizer:
    if not file.is_file():
        raise ModelLoadError(f"no {file.name} in {file.parent}; llmpipe needs the fast-tokenizer file")
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises bare Exception on malformed files
        raise ModelLoadError(f"cannot read {file}: {error}") from error


def _read_config(file: Path) -> dict[str, Any]:
    """The tokenizer config, or {} when absent (then no named special tokens and no template)."""
    return read_json(file) if file.is_file() else {}


def _token_text(value: Any) -> str | None:
    """A named token as configs spell it: a string, or an AddedToken dict with its text under "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja wins over the config's entry; a list of named templates yields its "default"."""
    file = path / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def save_hf_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """Write what load_hf_tokenizer reads back: tokenizer.json, the named special tokens in
    tokenizer_config.json, and chat_template.jinja."""
    tokenizer.backend.save(str(directory / TOKENIZER_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    if tokenizer.chat_template is not None:
        (directory / TEMPLATE_FILE).write_text(tokenizer.chat_template, encoding="utf-8")
