"""Tokenizer fixtures: ours and transformers' (the reference) on the same files, built once per session."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from tokenizer_helpers import varied_texts, write_tokenizer_gguf

from llmpipe.tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_gguf: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_reader: gguf.GGUFReader) -> Tokenizer:
    return load_gguf_tokenizer(smollm2_reader)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def tiny_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama_gqa")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir: Path) -> Tokenizer:
    return load_hf_tokenizer(tiny_dir)


@pytest.fixture(scope="session")
def tiny_reference(tiny_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def tiny_gguf(tiny_dir: Path, tmp_path_factory) -> Path:
    """The tiny tokenizer as a byte-level GGUF: qwen2 split regex, BOS added, one user-defined token."""
    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf"
    write_tokenizer_gguf(path, tiny_dir / "tokenizer.json")
    return path


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return varied_texts()
