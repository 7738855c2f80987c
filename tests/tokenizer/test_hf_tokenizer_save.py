"""save_hf_tokenizer writes files that load back (here and in transformers) to the same tokenizer."""

import pytest
from transformers import AutoTokenizer

from llmpipe.eval.perplexity import TEXT
from llmpipe.loader import load_checkpoint
from llmpipe.tokenizer.hf_tokenizer import load_hf_tokenizer, save_hf_tokenizer

SAMPLE = TEXT.read_text(encoding="utf-8")[:5000] + "<|im_start|>user\nHi there<|im_end|>\n  tabs\tand émojis 🎉"


def assert_same_tokenizer(original, tmp_path):
    save_hf_tokenizer(original, tmp_path)
    loaded = load_hf_tokenizer(tmp_path)
    assert loaded.encode(SAMPLE) == original.encode(SAMPLE)
    assert (loaded.bos_token_id, loaded.eos_token_id) == (original.bos_token_id, original.eos_token_id)
    assert loaded.special_tokens == original.special_tokens
    assert loaded.chat_template == original.chat_template
    assert AutoTokenizer.from_pretrained(tmp_path)(SAMPLE)["input_ids"] == original.encode(SAMPLE)


def test_hf_tokenizer_round_trips(tiny_checkpoint, tmp_path):
    assert_same_tokenizer(load_checkpoint(str(tiny_checkpoint("llama_gqa"))).tokenizer, tmp_path)


@pytest.mark.slow
def test_gguf_tokenizer_saves_as_hf_files(smollm2_gguf, tmp_path):
    assert_same_tokenizer(load_checkpoint(str(smollm2_gguf)).tokenizer, tmp_path)
