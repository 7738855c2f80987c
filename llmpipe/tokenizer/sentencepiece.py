"""SentencePiece-style BPE (GGUF `tokenizer.ggml.model = "llama"`): "▁" for spaces, byte fallback.

A GGUF stores such a vocabulary as tokens + scores + token types and no merges. SentencePiece's BPE
joins the adjacent pair whose joined piece ranks best; `tokenizers`' BPE does the same given merges
ordered by that rank, so the merges are derived from the vocabulary: every split of every token into
two tokens, best-ranked joined piece first (transformers' `generate_merges`, which its GGUF loader
uses, so the two agree token for token). The rank is the piece's score, except for Gemma, whose
file order is its merge order (its scores do not follow it), as transformers does.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"  # ▁, SentencePiece's spelling of a space
# Architectures whose merges follow file order, and whose whitespace-only tokens are stored with real
# spaces ("  ") where the model looks them up spelled "▁▁" (transformers' `gemma_tokenizer`).
FILE_ORDER_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


def build_sentencepiece_bpe(
    tokens: Sequence[str], scores: Sequence[float], unk_token: str | None, architecture: str | None,
    add_space_prefix: bool = True,
) -> tokenizers.Tokenizer:
    file_order = architecture in FILE_ORDER_ARCHITECTURES
    if file_order:
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks: Sequence[float] = range(0, -len(tokens), -1)
    else:
        ranks = scores
    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab, merges=derive_merges(vocab, dict(zip(tokens, ranks))),
        unk_token=unk_token, fuse_unk=True, byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(model)
    if file_order:  # GemmaTokenizer: no prefix space, every space spelled ▁
        backend.normalizer = normalizers.Replace(" ", SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    else:  # LlamaTokenizer: a space prepended to the first word (unless the file says not), stripped on decode
        scheme = "first" if add_space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
        strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
        backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return backend


def derive_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """(left, right) for every token split into two tokens; best-ranked joined token first, then the
    longer left part first (transformers' `generate_merges` order, ties included)."""
    merges = []
    append = merges.append  # ~2M lookups for Gemma's 262k tokens: keep the loop lean
    for piece, score in rank.items():
        for cut in range(1, len(piece)):
            left = piece[:cut]
            if left in vocab:
                right = piece[cut:]
                if right in vocab:
                    append((score, cut, len(piece) - cut, left, right))
    merges.sort(key=itemgetter(0, 1, 2), reverse=True)
    return [(m[3], m[4]) for m in merges]
