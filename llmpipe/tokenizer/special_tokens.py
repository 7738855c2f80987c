"""Special tokens on a `tokenizers.Tokenizer`: which ones stay whole, and the BOS/EOS an encode adds."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import tokenizers
from tokenizers import AddedToken, processors

logger = logging.getLogger(__name__)

# The named special tokens a chat template can refer to, as transformers names them.
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def add_whole_tokens(backend: tokenizers.Tokenizer, tokens: Iterable[str], *, special: bool) -> None:
    """Match `tokens` whole in the text before BPE runs; `special` ones are dropped by decode(skip=True).

    Only tokens the vocabulary spells exactly as the text does are added. One it spells otherwise
    (a byte-level vocabulary respells non-alphabet text) would get a new id past the model's
    embedding table, which no model can consume.
    """
    already = {added.content for added in backend.get_added_tokens_decoder().values()}
    whole = []
    for token in dict.fromkeys(tokens):
        if token in already:
            continue
        if backend.token_to_id(token) is None:
            logger.debug("not adding %r as a whole token: the vocabulary spells it differently", token)
            continue
        whole.append(AddedToken(token, normalized=False, special=special))
    if special:
        backend.add_special_tokens(whole)
    else:
        backend.add_tokens(whole)


def special_ids(backend: tokenizers.Tokenizer) -> frozenset[int]:
    """Ids of every added token marked special: the ones decode(skip_special_tokens=True) drops."""
    return frozenset(index for index, added in backend.get_added_tokens_decoder().items() if added.special)


def bos_eos_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """A post-processor that wraps one sequence (or a pair) in the given BOS and EOS tokens."""
    single = [f"{bos[0]}:0"] if bos else []
    single += ["$A:0"] + ([f"{eos[0]}:0"] if eos else [])
    pair = single + ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(t for t in (bos, eos) if t)))
