"""Copying checkpoint tensors (Hugging Face names) into a model, shared by every architecture.

A model lists its stacked parameters as (stacked name, checkpoint name part, shard index), e.g.
("qkv_proj", "q_proj", 0): q/k/v land in row slices of one matrix. Quantized linear layers take
their shards through `load_shard`; a quantized checkpoint tensor bound for a float layer is
dequantized first.
"""

from __future__ import annotations

import itertools
from typing import Iterable

import torch
from torch import nn

from llmpipe.errors import ModelLoadError
from llmpipe.quant.apply import QuantizedEmbedding
from llmpipe.quant.formats import QuantizedWeight
from llmpipe.quant.linear import QuantizedLinear

Stacking = tuple[tuple[str, str, int], ...]
EMBED = "model.embed_tokens.weight"


def target_of(name: str, stacked: Stacking) -> tuple[str, int | None]:
    """Checkpoint name → (model parameter name, shard index or None)."""
    for full, part, shard in stacked:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{full}."), shard
    return name, None


def shards(module_name: str, module: nn.Module, stacked: Stacking) -> list[tuple[str, slice]]:
    """Checkpoint prefixes of a module's rows: qkv_proj → q_proj, k_proj, v_proj slices (others: all rows)."""
    parent, _, last = module_name.rpartition(".")
    parts = sorted((shard, part) for full, part, shard in stacked if full == last)
    if not parts:
        return [(module_name, slice(None))]
    starts = [0, *itertools.accumulate(module.shard_sizes)]
    return [(f"{parent}.{part}", slice(starts[shard], starts[shard + 1])) for shard, part in parts]


@torch.no_grad()
def load_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], stacked: Stacking, tied: bool
) -> None:
    params = dict(model.named_parameters())
    quantized = {
        path: m for path, m in model.named_modules(remove_duplicate=False) if isinstance(m, QuantizedLinear)
    }
    embed = getattr(model.model, "embed_tokens", None)
    quantized_embed = embed if isinstance(embed, QuantizedEmbedding) else None
    tied_head = quantized_embed is not None and quantized_embed.shares_head
    expected = _expected_names(params, quantized, stacked, quantized_embed is not None, tied_head)
    loaded: set[str] = set()
    for name, tensor in weights:
        if name == "lm_head.weight" and tied:
            continue  # some tied checkpoints still carry a copy of the embedding
        target, shard = ("lm_head.weight", None) if (name == EMBED and tied_head) else target_of(name, stacked)
        module = quantized.get(target.removesuffix(".weight")) if target.endswith(".weight") else None
        if name == EMBED and quantized_embed is not None and not tied_head:
            module = quantized_embed.head
        if module is not None:
            _check_shape(name, tensor, (_shard_rows(module, shard), module.in_features))
            module.load_shard(shard, tensor)
        elif target in params:
            dense = tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()
            _copy_into(model, params[target], dense, shard, name, target)
        else:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the {model.config.architecture} model")
        loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[0]!r}")


def _expected_names(params: dict, quantized: dict, stacked: Stacking, quantized_embed: bool, tied_head: bool) -> set[str]:
    names = set()
    targets = list(params) + [f"{path}.weight" for path in quantized if ".embed_tokens." not in path]
    for name in targets:
        parts = [name.replace(f".{full}.", f".{part}.") for full, part, _ in stacked if f".{full}." in name]
        names.update(parts or [name])
    if tied_head:  # the quantized head is filled from the embedding
        names.discard("lm_head.weight")
    if quantized_embed:
        names.add(EMBED)
    return names


def _shard_rows(module: nn.Module, shard: int | None) -> int:
    sizes = getattr(module, "shard_sizes", None)
    return module.out_features if shard is None or sizes is None else sizes[shard]


def _check_shape(name: str, tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(shape)}")


def _copy_into(model: nn.Module, param: nn.Parameter, tensor: torch.Tensor, shard: int | None, name: str, target: str) -> None:
    dest = param.data
    if shard is not None:
        sizes = model.get_submodule(target.rsplit(".", 1)[0]).shard_sizes
        dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
    _check_shape(name, tensor, tuple(dest.shape))
    dest.copy_(tensor)
