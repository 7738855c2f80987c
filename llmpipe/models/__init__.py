"""Building a model from a checkpoint (its family, in registry.py, gives the module class)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from llmpipe.config import EngineConfig, ModelConfig
from llmpipe.kernels import huge_pages
from llmpipe.models.registry import family_of
from llmpipe.quant.apply import QuantPlan, module_plan, quantize_activations, quantize_linears
from llmpipe.quant.formats import QuantizedWeight
from llmpipe.quant.linear import QuantizedLinear

if TYPE_CHECKING:
    from llmpipe.loader import Checkpoint


def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
    dtype: torch.dtype,
    device: str | torch.device,
    plan: QuantPlan | None = None,
    activation_quantization: str | None = None,
    float_batch_weights: bool = False,
) -> nn.Module:
    """Allocate the model once on the target device (no random init), then copy the weights in.
    `plan` (checkpoint name → format) swaps those linear layers for quantized ones first;
    `activation_quantization` and `float_batch_weights` as EngineConfig's."""
    cls = family_of(config.architecture).model_class
    with torch.device("meta"):
        model = cls(config).to(dtype)
        if plan:
            quantize_linears(model, module_plan(plan, model.target_of, config.tie_word_embeddings), dtype)
    # model.to_empty(device) would take empty_like of each meta tensor: torch's Python reference for it
    # imports sympy (0.3 s of a 1B's load); torch.empty of the same shape allocates the same memory.
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    huge_pages.place_weights(model, fresh=True)  # pages become resident as weights arrive
    model.load_weights(weights)
    quantize_activations(model, activation_quantization)
    if float_batch_weights:
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                module.keep_float_copy()
    return model.eval().requires_grad_(False)


def load_model(checkpoint: "Checkpoint", config: EngineConfig, progress: bool = True) -> nn.Module:
    """The checkpoint's model in config's dtype, device and weight quantization."""
    plan = checkpoint.quant_plan(config.weight_quantization, config.group_size)
    weights = checkpoint.iter_weights(progress=progress, plan=plan)
    return build_model(checkpoint.config, weights, config.torch_dtype, config.device, plan,
                       config.activation_quantization, config.float_batch_weights)


def resident_bytes(model: nn.Module) -> int:
    """Resident weights: parameters and persistent buffers (quantized weights, their scales), and float
    copies kept for batches, each once."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    tensors.update({m.float_weight.data_ptr(): m.float_weight for m in model.modules()
                    if getattr(m, "float_weight", None) is not None})
    return sum(t.numel() * t.element_size() for t in tensors.values())
