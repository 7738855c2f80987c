"""Loader fixtures: reference state dicts of the tiny checkpoints and GGUF files made from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from llmpipe.loader import Checkpoint, load_checkpoint
from tests.loader.gguf_helpers import GGUF_ARCH_OF, hf_metadata, hf_tensors, write_gguf



@pytest.fixture(scope="session")
def transformers_model(tiny_checkpoint):
    """Factory: name → the transformers model loaded from that tiny checkpoint (cached)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def load(name: str):
        if name not in cache:
            cache[name] = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(name), dtype=torch.float32)
        return cache[name]

    return load


@pytest.fixture
def tiny_gguf(tiny_checkpoint, transformers_model, tmp_path):
    """Factory: (tiny config name, HF names to quantize → type) → path of an equivalent GGUF."""

    def make(name: str, qtypes: dict[str, GGMLQuantizationType] | None = None, **extra_metadata) -> Path:
        model = transformers_model(name)
        arch = GGUF_ARCH_OF[name]
        tensors = hf_tensors(model.state_dict(), model.config, arch, qtypes or {})
        metadata = hf_metadata(model.config, arch) | extra_metadata
        return write_gguf(tmp_path / f"{name}.gguf", arch, metadata, tensors)

    return make


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf) -> Checkpoint:
    return load_checkpoint(str(smollm2_gguf))


@pytest.fixture(scope="session")
def smollm2_weights(smollm2) -> dict[str, torch.Tensor]:
    return dict(smollm2.iter_weights())
