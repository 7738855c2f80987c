"""The model's vocabulary as llguidance sees it: each token id's bytes (special tokens marked),
read from llmpipe's own Tokenizer, never from a transformers tokenizer."""

from __future__ import annotations

from collections.abc import Iterable

import llguidance

from llmpipe.tokenizer import Tokenizer

_SPECIAL = b"\xff"  # llguidance's prefix for a token that no text spells (EOS, <|im_start|>, ...)


class _TokenBytes:
    """What llguidance.TokenizerWrapper reads: the bytes per id, the special ids and an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(i for i in tokenizer.all_special_ids if i < vocab_size)
        special = set(self.special_token_ids)
        known = min(vocab_size, tokenizer.vocab_size)
        self.tokens = [self._spelling(i, i in special) for i in range(known)] + [b""] * (vocab_size - known)

    def _spelling(self, token_id: int, special: bool) -> bytes:
        if special:
            return _SPECIAL + (self.tokenizer.id_to_token(token_id) or f"<[{token_id}]>").encode("utf-8")
        return self.tokenizer.token_bytes(token_id)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self.tokenizer.encode(text, add_special_tokens=False)


def grammar_vocabulary(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """vocab_size: the width of the model's logits (padding ids past the tokenizer's spell nothing)."""
    wrapper = llguidance.TokenizerWrapper(_TokenBytes(tokenizer, vocab_size))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
