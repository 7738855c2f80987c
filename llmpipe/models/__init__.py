"""Model registry: architecture name → module class, and building a model from a checkpoint."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from llmpipe.config import GEMMA3_FAMILY, LLAMA_FAMILY, ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.layers.rotary import RotaryEmbedding
from llmpipe.models.gemma3 import Gemma3ForCausalLM
from llmpipe.models.llama import LlamaForCausalLM
from llmpipe.quant.apply import QuantPlan, module_plan, quantize_linears
from llmpipe.quant.formats import QuantizedWeight

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    **{arch: LlamaForCausalLM for arch in LLAMA_FAMILY},
    **{arch: Gemma3ForCausalLM for arch in GEMMA3_FAMILY},
}


def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
    dtype: torch.dtype,
    device: str | torch.device,
    plan: QuantPlan | None = None,
) -> nn.Module:
    """Allocate the model once on the target device (no random init), then copy the weights in.
    `plan` (checkpoint name → format) swaps those linear layers for quantized ones first."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported (supported: {', '.join(sorted(MODEL_CLASSES))})"
        )
    with torch.device("meta"):
        model = cls(config).to(dtype)
        if plan:
            quantize_linears(model, module_plan(plan, model.target_of, config.tie_word_embeddings), dtype)
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_tables()
    model.load_weights(weights)
    return model.eval().requires_grad_(False)
