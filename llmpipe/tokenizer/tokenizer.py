"""The Tokenizer: text ↔ token ids, the model's special tokens, and its chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import json
import re

import tokenizers

from llmpipe.errors import InvalidRequestError
from llmpipe.tokenizer import byte_level
from llmpipe.tokenizer.chat_template import render_chat_template
from llmpipe.tokenizer.special_tokens import special_ids

_LONG = 1024  # ids: a decode this long goes through the batch call
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class Tokenizer:
    """Wraps a Hugging Face `tokenizers.Tokenizer` plus the special-token facts and chat template.

    Encoding adds BOS/EOS through the backend's post-processor, so `add_bos_token` reports what
    the file configured rather than steering encode().
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        special_tokens: Mapping[str, str],
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        # Named special tokens as chat templates see them: {"bos_token": "<s>", ...}.
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self.all_special_ids = special_ids(backend)
        self._add_bos_token = bos_token_id is not None and self.encode("")[:1] == [bos_token_id]

    @property
    def add_bos_token(self) -> bool:
        """Whether encode(add_special_tokens=True) prepends BOS."""
        return self._add_bos_token

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # The backend's batch calls release the GIL while they work (its single ones do not), so a
    # long text tokenized on a server's worker thread does not stall the event loop or the engine.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > _LONG:
            return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), in O(len(text)) without tokenizing: no token covers
        more than max_token_bytes bytes (halved, in case a normalizer shortens the text)."""
        return len(text.encode("utf-8", "surrogatepass")) // (2 * self.max_token_bytes)

    @cached_property
    def max_token_bytes(self) -> int:
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max(len(token.encode("utf-8", "surrogatepass")) for token in vocab) or 1

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for, even when they are part of a UTF-8 sequence (decoding the
        token alone would give U+FFFD): what OpenAI's logprobs `bytes` carry."""
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self._added_token_ids or self._vocabulary_kind == "text":
            return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
        if self._vocabulary_kind == "byte_level":
            return byte_level.token_bytes(token)
        byte = _BYTE_PIECE.fullmatch(token)  # SentencePiece: "<0xE4>" is one byte, "▁" a space
        return bytes([int(byte.group(1), 16)]) if byte else token.replace("\u2581", " ").encode("utf-8")

    @cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @cached_property
    def _vocabulary_kind(self) -> str:
        """How vocabulary entries spell bytes, read from the backend's decoder: "byte_level" (GPT-2's
        alphabet), "sentencepiece" (byte fallback, "▁" for spaces) or "text" (entries are text)."""
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        return "byte_level" if "ByteLevel" in kinds else "sentencepiece" if "ByteFallback" in kinds else "text"

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for a conversation; `extra` reaches the template too (tools, enable_thinking)."""
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template, so chat messages cannot be turned into a prompt; "
                "send a plain text prompt instead"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **extra},
        )
