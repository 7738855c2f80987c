"""A SentencePiece-style ("llama") GGUF vocabulary without Gemma's quirks (Llama 2 / Mistral style:
merge order from the scores, a prefix space) against transformers' GGUF tokenizer."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizer_helpers import assert_encodes_like_reference, varied_texts

from llmpipe.tokenizer import load_gguf_tokenizer

NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def write_sentencepiece_gguf(path: Path) -> None:
    """A 600-piece vocabulary trained on a little text: <unk> <s> </s>, 256 byte pieces, then pieces
    scored by rank (SentencePiece's own order)."""
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer()
    corpus = varied_texts(300, seed=3) + ["the quick brown fox jumps over the lazy dog"] * 20
    trainer.train_from_iterator(corpus, vocab_size=600, show_progress=False)
    pieces = [p for p, _ in sorted(trainer.get_vocab().items(), key=lambda item: item[1])]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *bytes_, *(p for p in pieces if p not in bytes_)]
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(tokens) - 3 - 256)]
    kinds = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(tokens) - 3 - 256)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(kinds)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("placeholder", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    write_sentencepiece_gguf(path)
    return load_gguf_tokenizer(gguf.GGUFReader(path)), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_sentencepiece_gguf_encodes_and_decodes_like_transformers(pair):
    ours, reference = pair
    texts = varied_texts(400, seed=11)
    assert_encodes_like_reference(ours, reference, texts, add_special_tokens=True)
    for text in texts[:200]:
        ids = reference(text)["input_ids"]
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), repr(text)


def test_sentencepiece_gguf_adds_bos_by_default_and_falls_back_to_bytes(pair):
    ours, _ = pair
    assert ours.add_bos_token and ours.encode("x")[0] == 1  # the file says nothing: llama.cpp adds BOS
    ids = ours.encode("\u0915", add_special_tokens=False)  # a character the vocabulary lacks
    assert [ours.id_to_token(i) for i in ids][-3:] == ["<0xE0>", "<0xA4>", "<0x95>"]
