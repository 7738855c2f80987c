"""GGUF tokenizers against transformers' tokenizer loaded from the same file."""

from __future__ import annotations

import random
import time
from pathlib import Path

import gguf
import pytest
from tokenizer_helpers import MISLABELED_CONTROL, USER_DEFINED, assert_encodes_like_reference, write_tokenizer_gguf

from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.tokenizer import load_gguf_tokenizer


def random_id_runs(vocab_size: int, special: list[int], count: int, seed: int = 1) -> list[list[int]]:
    """Arbitrary id sequences: bytes that do not form valid UTF-8, special tokens in odd places."""
    rng = random.Random(seed)
    pool = list(range(vocab_size)) + special * 50
    return [[rng.choice(pool) for _ in range(rng.randint(1, 40))] for _ in range(count)]


@pytest.mark.slow
def test_gguf_vocabulary_and_special_tokens_match_transformers(smollm2_tokenizer, smollm2_reference):
    ours, ref = smollm2_tokenizer, smollm2_reference
    assert ours.backend.get_vocab() == ref.get_vocab()
    assert ours.vocab_size == len(ref) == 49152
    added = {i: (t.content, t.special) for i, t in ref.backend_tokenizer.get_added_tokens_decoder().items()}
    assert {i: (t.content, t.special) for i, t in ours.backend.get_added_tokens_decoder().items()} == added
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.add_bos_token is False and ref.add_bos_token is False
    assert ours.special_tokens == ref.special_tokens_map


@pytest.mark.slow
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_gguf_encode_matches_transformers_on_varied_texts(smollm2_tokenizer, smollm2_reference, texts,
                                                          add_special_tokens):
    assert_encodes_like_reference(smollm2_tokenizer, smollm2_reference, texts, add_special_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_gguf_decode_matches_transformers_on_encoded_and_random_ids(smollm2_tokenizer, smollm2_reference, texts,
                                                                    skip_special_tokens):
    runs = smollm2_reference(texts)["input_ids"]
    runs += random_id_runs(smollm2_tokenizer.vocab_size, sorted(smollm2_tokenizer.all_special_ids), 500)
    expected = smollm2_reference.batch_decode(runs, skip_special_tokens=skip_special_tokens)
    for ids, text in zip(runs, expected, strict=True):
        assert smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == text, ids


@pytest.mark.slow
def test_gguf_pre_tokenizer_splits_like_transformers(smollm2_tokenizer, smollm2_reference, texts):
    ours, ref = smollm2_tokenizer.backend.pre_tokenizer, smollm2_reference.backend_tokenizer.pre_tokenizer
    assert [ours.pre_tokenize_str(t) for t in texts] == [ref.pre_tokenize_str(t) for t in texts]


@pytest.mark.slow
def test_gguf_tokenizer_builds_without_a_quadratic_merge_pass(smollm2_reader):
    """49,152 tokens and their merges: a bound only against a pathological (hanging) build."""
    start = time.perf_counter()
    load_gguf_tokenizer(smollm2_reader)
    assert time.perf_counter() - start < 60


@pytest.fixture(scope="module")
def tiny_gguf_pair(tiny_gguf: Path):
    from transformers import AutoTokenizer

    ours = load_gguf_tokenizer(gguf.GGUFReader(tiny_gguf))
    return ours, AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)


def test_gguf_split_regex_bos_and_user_tokens_match_transformers(tiny_gguf_pair, texts):
    ours, ref = tiny_gguf_pair
    assert ours.add_bos_token and ref.add_bos_token
    # transformers also adds GPT-2's default "<|endoftext|>" at a new id past the vocabulary; we do not.
    usable = [t for t in texts if "<|endoftext|>" not in t] + ["the other brother", MISLABELED_CONTROL + "hi<s>"]
    for add_special_tokens in (True, False):
        expected = ref(usable, add_special_tokens=add_special_tokens)["input_ids"]
        for text, ids in zip(usable, expected, strict=True):
            assert ours.encode(text, add_special_tokens=add_special_tokens) == ids, repr(text)
    for skip in (True, False):
        assert [ours.decode(ids, skip_special_tokens=skip) for ids in expected] == ref.batch_decode(
            expected, skip_special_tokens=skip
        )


def test_gguf_pre_kind_selects_the_split_regex_transformers_uses(tiny_gguf_pair, texts):
    ours, ref = tiny_gguf_pair
    ours, ref = ours.backend.pre_tokenizer, ref.backend_tokenizer.pre_tokenizer
    assert [ours.pre_tokenize_str(t) for t in texts] == [ref.pre_tokenize_str(t) for t in texts]
    assert ours.pre_tokenize_str("x 123") == [("x", (0, 1)), ("Ġ", (1, 2)), ("1", (2, 3)), ("2", (3, 4)), ("3", (4, 5))]


def test_gguf_user_defined_token_is_matched_whole_but_not_special(tiny_gguf_pair):
    ours, _ = tiny_gguf_pair
    the = ours.token_to_id(USER_DEFINED)
    assert the in ours.encode("other", add_special_tokens=False)
    assert the not in ours.all_special_ids


def test_gguf_tokenizer_never_invents_ids_past_the_vocabulary(tiny_gguf_pair):
    ours, ref = tiny_gguf_pair
    assert ours.vocab_size == ref.backend_tokenizer.get_vocab_size(with_added_tokens=False)
    assert max(ours.encode("<|endoftext|>" + MISLABELED_CONTROL)) < ours.vocab_size


def test_gguf_with_unsupported_tokenizer_model_raises_naming_the_model(tiny_dir, tmp_path):
    path = tmp_path / "bert.gguf"
    write_tokenizer_gguf(path, tiny_dir / "tokenizer.json", model="bert")
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        load_gguf_tokenizer(gguf.GGUFReader(path))


def test_gguf_byte_level_without_merges_is_a_load_error(tiny_dir, tmp_path):
    path = tmp_path / "nomerges.gguf"
    write_tokenizer_gguf(path, tiny_dir / "tokenizer.json", with_merges=False)
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.merges"):
        load_gguf_tokenizer(gguf.GGUFReader(path))


def test_gguf_without_tokenizer_metadata_is_a_load_error(tmp_path):
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.model"):
        load_gguf_tokenizer(gguf.GGUFReader(path))
