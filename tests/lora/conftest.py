"""The LoRA tests' models: the tiny Llama checkpoint, its transformers model (PEFT's base) and llmpipe's engine."""

from __future__ import annotations

import pytest

from llmpipe import LLM
from tests.lora.helpers import hf_model


@pytest.fixture(scope="session")
def lora_base(tiny_checkpoint):
    """(checkpoint directory, transformers model) of the tiny GQA Llama."""
    path = tiny_checkpoint("llama_gqa")
    return path, hf_model(path)


@pytest.fixture(scope="session")
def lora_llm(lora_base):
    return LLM(str(lora_base[0]), dtype="float32", progress=False)
