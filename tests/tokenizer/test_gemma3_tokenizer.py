"""The SentencePiece-style tokenizer of the real Gemma 3 270M GGUF against transformers' GGUF
tokenizer: encode on 1,300+ varied strings, decode, BOS, and Gemma 3's chat template."""

from __future__ import annotations

import pytest
from tokenizer_helpers import assert_encodes_like_reference, varied_texts

from llmpipe.tokenizer.default_templates import GEMMA3_CHAT_TEMPLATE

pytestmark = pytest.mark.slow

# Gemma's own kinds of text: its control and user-defined tokens, runs of spaces, tabs and newlines
# (whole tokens in its vocabulary), byte-fallback characters.
GEMMA_TEXTS = [
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad><mask><unused7>",
    "<start_of_turn", "end_of_turn>", "</iframe></footer><table><tr>",
    "a  b   c    d     e", "\t\tindented\n\n\n\nparagraph", "   leading and trailing   ",
    "  \n  \t  ", "\u0000\u0001\u007f control", "\U0001f9ea\U0001fae0 new emoji", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ℌ𝔢𝔞𝔡𝔦𝔫𝔤",
    "    def f(self):\n        return {'a': [1, 2, 3]}\n",
]


@pytest.fixture(scope="module")
def ours(gemma3_llm):
    return gemma3_llm.get_tokenizer()


@pytest.fixture(scope="module")
def reference(gemma3_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)


TEXTS = varied_texts(1300, seed=7) + GEMMA_TEXTS


def test_encode_matches_transformers_on_varied_texts(ours, reference):
    assert len(TEXTS) >= 1000
    assert_encodes_like_reference(ours, reference, TEXTS, add_special_tokens=True)
    assert_encodes_like_reference(ours, reference, TEXTS[:300], add_special_tokens=False)


def test_bos_is_added_once_and_decode_matches_transformers(ours, reference):
    assert ours.add_bos_token and ours.encode("hi")[0] == ours.bos_token_id == 2
    assert ours.encode("hi", add_special_tokens=False)[0] != 2
    for text in TEXTS[:300]:
        ids = reference(text)["input_ids"]
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), repr(text)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), repr(text)


def test_gemma3_chat_template_renders_the_ids_transformers_renders(ours, reference):
    assert ours.chat_template == GEMMA3_CHAT_TEMPLATE  # the base model's GGUF has none
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  What is 2+2?  "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    text = ours.apply_chat_template(conversation, add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n")
    assert text.endswith("<start_of_turn>model\n")
    expected = reference.apply_chat_template(
        conversation, chat_template=GEMMA3_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True
    )
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ours.encode(text, add_special_tokens=False) == list(expected)
