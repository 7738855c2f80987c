"""Hugging Face directory tokenizers against transformers' AutoTokenizer on the same directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmpipe.errors import ModelLoadError
from llmpipe.tokenizer import load_hf_tokenizer
from tokenizer_helpers import assert_encodes_like_reference


def test_hf_dir_special_tokens_match_transformers(tiny_tokenizer, tiny_reference):
    assert (tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id) == (1, 2)
    assert (tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id) == (
        tiny_reference.bos_token_id,
        tiny_reference.eos_token_id,
    )
    assert tiny_tokenizer.add_bos_token == tiny_reference.add_bos_token
    assert tiny_tokenizer.special_tokens == tiny_reference.special_tokens_map
    assert tiny_tokenizer.vocab_size == len(tiny_reference)
    assert tiny_tokenizer.all_special_ids == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_hf_dir_encode_matches_transformers_on_varied_texts(tiny_tokenizer, tiny_reference, texts,
                                                            add_special_tokens):
    assert_encodes_like_reference(tiny_tokenizer, tiny_reference, texts, add_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_hf_dir_decode_matches_transformers(tiny_tokenizer, tiny_reference, texts, skip_special_tokens):
    runs = tiny_reference(texts)["input_ids"]
    expected = tiny_reference.batch_decode(runs, skip_special_tokens=skip_special_tokens)
    for ids, text in zip(runs, expected, strict=True):
        assert tiny_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == text


def test_hf_dir_bos_from_tokenizer_json_post_processor_is_added_like_transformers(tiny_dir, tmp_path):
    spec = json.loads((tiny_dir / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    folder = _copy(tiny_dir, tmp_path)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    from transformers import AutoTokenizer

    tokenizer, reference = load_hf_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert tokenizer.add_bos_token
    assert tokenizer.encode("fox") == reference.encode("fox") == [1, *reference.encode("fox", add_special_tokens=False)]


def test_hf_dir_without_tokenizer_json_is_a_load_error(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_hf_tokenizer(folder)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_hf_dir_with_corrupt_file_is_a_load_error(tiny_dir, tmp_path, name):
    folder = _copy(tiny_dir, tmp_path)
    (folder / name).write_text('{"truncated": ')
    with pytest.raises(ModelLoadError, match=name):
        load_hf_tokenizer(folder)


def test_hf_dir_template_from_config_when_no_jinja_file(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_hf_tokenizer(folder).chat_template == template


def _copy(tiny_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_dir / name, folder / name)
    return folder
