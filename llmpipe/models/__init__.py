"""Model registry: architecture name → module class, and building a model from a checkpoint."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from llmpipe.config import LLAMA_FAMILY, ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.layers.rotary import RotaryEmbedding
from llmpipe.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in LLAMA_FAMILY}


def build_model(
    config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: str | torch.device
) -> nn.Module:
    """Allocate the model once on the target device (no random init), then copy the weights in."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported (supported: {', '.join(sorted(MODEL_CLASSES))})"
        )
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device=device)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_tables()
    model.load_weights(weights)
    return model.eval().requires_grad_(False)
