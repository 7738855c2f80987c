"""Which linear layers get which weight format, and swapping them into a model before it is loaded.

A plan maps checkpoint tensor names to formats: ("int8", None), ("int4", group_size) or, from GGUF,
("int8", 32 / 16) and ("q5_0", 32). Runtime
round-to-nearest puts every linear weight in one format; a GGUF in "auto" mode keeps each
tensor of a type in loader/gguf_weights.NATIVE_FORMATS (and a GPTQ / AWQ directory each quantized tensor) in
the format it already is.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from llmpipe.layers.linear import Linear
from llmpipe.kernels import ops
from llmpipe.quant.linear import GGMLLinear, Int4Linear, Int8Linear, Q5_0Linear, QuantizedLinear

logger = logging.getLogger(__name__)
WeightFormat = tuple[str, int | None]
QuantPlan = dict[str, WeightFormat | None]  # checkpoint name → format (None: float)
Q5_0_FORMAT: WeightFormat = ("q5_0", 32)
GGML_FORMAT: WeightFormat = ("ggml", None)  # a GGUF's own blocks, of any type the GGML kernels read
LAYERS = {"int8": Int8Linear, "int4": Int4Linear, Q5_0_FORMAT[0]: Q5_0Linear, GGML_FORMAT[0]: GGMLLinear}


def quant_plan(
    linear_names: list[str],
    quantization: str | None,
    group_size: int,
    native_format: Callable[[str], WeightFormat | None] | None,
) -> QuantPlan:
    """Formats for the checkpoint's linear weights (its family's `linear_weights`)."""
    if quantization in ("int8", "int4"):
        fmt: WeightFormat = (quantization, group_size if quantization == "int4" else None)
        return {n: fmt for n in linear_names}
    if quantization == "auto" and native_format is not None:
        return {name: native_format(name) for name in linear_names}  # None: not quantized in the file
    return {}


def module_plan(plan: QuantPlan, target_of: Callable[[str], str], tied_embeddings: bool) -> dict[str, WeightFormat]:
    """Checkpoint names → the model's module paths. A stacked module (q/k/v, gate/up) is quantized
    only if all its checkpoint tensors share one format (a GGUF may mix Q5_0 q/k with a Q8_0 v: those
    meet as int8, which holds Q5_0's codes exactly); otherwise it stays float and quantized shards are
    dequantized into it."""
    formats: dict[str, set] = {}
    for name, fmt in plan.items():
        if name == "model.embed_tokens.weight":
            if tied_embeddings:
                formats.setdefault("lm_head", set()).add(fmt)
            elif fmt == GGML_FORMAT:  # kept as the file's blocks, rows dequantized on lookup
                formats.setdefault("model.embed_tokens", set()).add(fmt)
            continue
        formats.setdefault(target_of(name).removesuffix(".weight"), set()).add(fmt)
    for fmts in formats.values():
        if fmts == {Q5_0_FORMAT, ("int8", Q5_0_FORMAT[1])}:
            fmts.discard(Q5_0_FORMAT)
    return {path: next(iter(fmts)) for path, fmts in formats.items() if len(fmts) == 1 and None not in fmts}


class QuantizedEmbedding(nn.Module):
    """An embedding held quantized, its rows dequantized on lookup: the LM head's matrix where the two are
    tied (`shares_head`: one copy, not a float one beside a quantized one), or a GGUF's own blocks of an
    untied embedding (an 8B's 128,256 x 4,096 takes its 0.3 GiB of Q4_K, not 2 GiB of float32)."""

    def __init__(self, head: QuantizedLinear, dtype: torch.dtype, shares_head: bool = True):
        super().__init__()
        self.head, self.dtype, self.shares_head = head, dtype, shares_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed(ids).to(self.dtype)


def new_quantized_linear(
    in_features: int, out_features: int, bias: bool, fmt: WeightFormat, dtype: torch.dtype
) -> QuantizedLinear:
    kind, group = fmt
    module: QuantizedLinear = LAYERS[kind](in_features, out_features, bias, group)
    if module.bias is not None:
        module.bias.data = module.bias.data.to(dtype)
    return module


def quantize_linears(model: nn.Module, plan: dict[str, WeightFormat], dtype: torch.dtype) -> None:
    """Swap the model's Linear modules named in `plan` (module path → format) for quantized twins.

    The key "lm_head" on a model with tied embeddings creates a quantized head that the
    embedding then reads its rows from (one copy of the matrix, not a float one plus a quantized one).
    """
    for path, module in list(model.named_modules()):
        if isinstance(module, Linear) and path in plan:
            twin = new_quantized_linear(module.in_features, module.out_features, module.bias is not None, plan[path], dtype)
            twin.shard_sizes = getattr(module, "shard_sizes", twin.shard_sizes)
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent), attr, twin)
    embed = model.model.embed_tokens
    if getattr(model, "lm_head", None) is None and "lm_head" in plan:
        model.lm_head = new_quantized_linear(embed.embedding_dim, embed.num_embeddings, False, plan["lm_head"], dtype)
        model.model.embed_tokens = QuantizedEmbedding(model.lm_head, dtype)
    elif "model.embed_tokens" in plan:
        matrix = new_quantized_linear(embed.embedding_dim, embed.num_embeddings, False, plan["model.embed_tokens"], dtype)
        model.model.embed_tokens = QuantizedEmbedding(matrix, dtype, shares_head=False)


ACTIVATION_BITS = {"int8": 8, "int16": 16}  # activation_quantization → the kernels' bits
# What "auto" (the default) picks where the integer-dot kernels run: 16-bit blocks agree with the
# float path to float32 rounding (SmolLM2 Q4_1: perplexity 33.3681 vs 33.3680, every greedy token
# the same) and decode as fast as int8 blocks (docs/benchmarks.md, "Against llama.cpp").
AUTO_ACTIVATIONS = "int16"


def quantize_activations(model: nn.Module, activation_quantization: str | None) -> None:
    """"int8" / "int16": every quantized linear multiplies activation blocks quantized to 8 or 16 bits
    (the integer-dot kernels); where those kernels cannot be built the layers keep float activations
    (after one warning). "auto": AUTO_ACTIVATIONS where the kernels run, float activations (silently)
    where they do not. None: float activations."""
    if activation_quantization is None:
        return
    if activation_quantization == "auto":
        if not ops.dot_available():
            return
        activation_quantization = AUTO_ACTIVATIONS
    if not ops.dot_available():
        logger.warning("activation_quantization=%r: the integer-dot kernels are not available; "
                       "activations stay float32", activation_quantization)
        return
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.activation_bits = ACTIVATION_BITS[activation_quantization]


def activation_bits(model: nn.Module) -> int | None:
    """The widest activation blocks the model's quantized layers take (None: float activations)."""
    return max((m.activation_bits for m in model.modules() if isinstance(m, QuantizedLinear)
                and m.activation_bits is not None), default=None)


def quantize_prefill(model: nn.Module) -> int:
    """Send batches of every size through the integer-dot kernels of the layers with quantized
    activations (to evaluate the decode numerics at every position); returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.activation_bits is not None]
    for module in layers:
        module.quantized_prefill = True
    return len(layers)
