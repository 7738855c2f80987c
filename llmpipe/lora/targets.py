"""Which linear layers of a model an adapter may change, by the checkpoint names adapter files use.

PEFT and llama.cpp name the modules as the checkpoint does (q_proj, k_proj, v_proj); llmpipe stacks some of
them into one module (qkv_proj). `LoRATargets` maps each checkpoint module name to the llmpipe module and
the rows it fills (the family's `stacked` table and the module's `shard_sizes`, as weight loading does),
and assembles per-checkpoint-module factors into a `LoRAAdapter` of stacked ones.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from llmpipe.errors import InvalidRequestError, UnsupportedModelError
from llmpipe.layers.linear import Linear
from llmpipe.lora.adapter import LoRAAdapter, LoRAFactors
from llmpipe.models.registry import family_of
from llmpipe.models.weights import shards
from llmpipe.quant.linear import QuantizedLinear

UNADAPTED = ("embed_tokens", "lm_head")  # token embeddings and the head: llmpipe adapts linear layers only


def adaptable(module: nn.Module) -> bool:
    """A linear layer whose output a LoRA delta can be added to: float or any quantized kind."""
    return isinstance(module, (Linear, QuantizedLinear))


class LoRATargets:
    def __init__(self, model: nn.Module, max_lora_rank: int):
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.config = model.config
        stacked = family_of(model.config.architecture).stacked
        self.modules: dict[str, nn.Module] = {}
        # checkpoint module name → (llmpipe module name, shard index, rows of the module's output)
        self.shard_of: dict[str, tuple[str, int, slice]] = {}
        for name, module in model.named_modules():
            if not adaptable(module) or set(name.split(".")) & set(UNADAPTED):  # a tied head: embed_tokens.head
                continue
            self.modules[name] = module
            for shard, (prefix, rows) in enumerate(shards(name, module, stacked)):
                self.shard_of[prefix] = (name, shard, rows)

    def shard_count(self, module_name: str) -> int:
        return sum(1 for name, _, _ in self.shard_of.values() if name == module_name)

    def check_name(self, checkpoint_module: str, path: Path) -> None:
        if checkpoint_module.rpartition(".")[2] in UNADAPTED:
            raise UnsupportedModelError(f"{path}: the adapter changes {checkpoint_module}; llmpipe adapts linear layers only, "
                                        "not the embedding or the LM head")
        if checkpoint_module not in self.shard_of:
            raise UnsupportedModelError(f"{path}: the adapter targets {checkpoint_module!r}, which is not a linear layer of "
                                        f"this {self.config.architecture} model")

    def check_shape(self, checkpoint_module: str, factor: str, shape: tuple[int, ...], path: Path) -> None:
        """A factor's shape, checked before the file's tensor is read (a file must not make the engine allocate
        more than the model's own layer shapes at max_lora_rank): A [r, in], B [out rows of its shard, r]."""
        self.check_name(checkpoint_module, path)
        module_name, _, rows = self.shard_of[checkpoint_module]
        module = self.modules[module_name]
        out_rows = len(range(module.out_features)[rows])
        fixed, expected = (shape[1:], (module.in_features,)) if factor == "A" else (shape[:1], (out_rows,))
        if len(shape) != 2 or tuple(fixed) != expected:
            raise UnsupportedModelError(f"{path}: {checkpoint_module}'s lora_{factor} has shape {shape}; the model's layer "
                                        f"takes {module.in_features} inputs to {out_rows} outputs")
        rank = shape[0] if factor == "A" else shape[1]
        if rank > self.max_lora_rank:
            raise InvalidRequestError(f"{path}: {checkpoint_module} has rank {rank}, above max_lora_rank "
                                      f"{self.max_lora_rank}", param="max_lora_rank")

    def assemble(self, name: str, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], path: Path) -> LoRAAdapter:
        """factors: checkpoint module name → (A [r, in], B [out rows of its shard, r], scale folded in)."""
        by_module: dict[str, list[tuple[int, slice, torch.Tensor, torch.Tensor]]] = {}
        rank = 0
        for checkpoint_module, (a, b) in factors.items():
            self.check_shape(checkpoint_module, "A", tuple(a.shape), path)
            self.check_shape(checkpoint_module, "B", tuple(b.shape), path)
            if a.shape[0] != b.shape[1]:
                raise UnsupportedModelError(f"{path}: {checkpoint_module}'s factors have ranks {a.shape[0]} and {b.shape[1]}")
            module_name, shard, rows = self.shard_of[checkpoint_module]
            rank = max(rank, a.shape[0])
            by_module.setdefault(module_name, []).append((shard, rows, a.float(), b.float()))
        if not by_module:
            raise UnsupportedModelError(f"{path}: the adapter holds no LoRA factors")
        return LoRAAdapter(name, rank, {m: self._stack(self.modules[m], parts) for m, parts in by_module.items()}, path)

    @staticmethod
    def _stack(module: nn.Module, parts: list[tuple[int, slice, torch.Tensor, torch.Tensor]]) -> LoRAFactors:
        parts.sort(key=lambda p: p[0])
        a = torch.cat([p[2] for p in parts])
        b = torch.zeros(module.out_features, a.shape[0])
        column = 0
        for _, rows, _, shard_b in parts:
            b[rows, column : column + shard_b.shape[1]] = shard_b
            column += shard_b.shape[1]
        return LoRAFactors(a.contiguous(), b)
