"""GGUF tensor names → Hugging Face names: one table per GGUF architecture, owned by its model family.

A mixture of experts' GGUF holds each layer's experts as one 3-D tensor ([experts, out, in], e.g.
ffn_gate_exps; their biases, where they have any, [experts, out]); `experts` names the per-expert Hugging
Face tensor each slice of it stands for, so expert e is read as the rows of its own slice, in place, as any
other linear's weight.

llama.cpp's converter permutes the rows of attn_q / attn_k (weight and bias) for the "llama"
architecture only (its LlamaModel.modify_tensors; Qwen2Model and Qwen3Model do not), turning
Hugging Face's rotate-half RoPE layout into interleaved pairs. `permuted` names the tensors whose
rows must be put back, with the ModelConfig field that gives their head count. `values` undoes what
else a converter changed in a small float tensor's values or shape (Qwen3.5's −exp(A_log), 1 + norm weights).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class GGUFArchitecture:
    tensors: dict[str, str]  # GGUF name pattern → Hugging Face name pattern ({i} = layer)
    experts: dict[str, str] = field(default_factory=dict)  # an experts tensor's pattern → its slices' ({e} = expert)
    permuted: dict[str, str] = field(default_factory=dict)  # GGUF pattern → head-count field
    # Gemma's RMSNorm scales by (1 + weight); llama.cpp's converter stores 1 + weight, so loading subtracts it.
    norms_store_one_plus_weight: bool = False
    end_of_turn: str | None = None  # a token llama.cpp also stops at, found by its text where no eot id is given
    # GGUF pattern → the function giving the model's tensor from the file's (dequantized, as float)
    values: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    partial_rotary: bool = False  # rope.dimension_count may be less than the head dim (the family reads it)

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor, or None for tensors the model does not load."""
        pattern, layer = pattern_of(gguf_name)
        hf_pattern = self.tensors.get(pattern)
        return None if hf_pattern is None else hf_pattern.format(i=layer)

    def value_of(self, gguf_name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.values.get(pattern_of(gguf_name)[0])

    def expert_names(self, gguf_name: str, experts: int) -> list[str] | None:
        """The Hugging Face names of an experts tensor's slices, expert 0 first; None if it is not one."""
        pattern, layer = pattern_of(gguf_name)
        hf_pattern = self.experts.get(pattern)
        return None if hf_pattern is None else [hf_pattern.format(i=layer, e=e) for e in range(experts)]


# What llama.cpp's converter writes with its optional fusions (gguf_weights.split_fused reads them apart).
FUSED_EXPERTS = "blk.{i}.ffn_gate_up_exps.weight"  # --fuse-gate-up-exps: each expert's gate rows, then its up rows
FUSED_QKV, SEPARATE_Q, ATTENTION_OUTPUT = "blk.{i}.attn_qkv.weight", "blk.{i}.attn_q.weight", "blk.{i}.attn_output.weight"
FUSED_QKV_BIAS = "blk.{i}.attn_qkv.bias"


def converter_fusions(names: list[str], arch: GGUFArchitecture) -> dict[str, str]:
    """The tensors among `names` that llama.cpp's optional fusions wrote where the model's table reads their parts,
    each with its option: a layer's ffn_gate_up_exps (--fuse-gate-up-exps) where the table has none, and an attention
    layer's attn_qkv and its bias (--fuse-qkv) where the table reads attn_q (Phi-3's own attn_qkv and Qwen3.5's linear
    layers, which have no attn_output, are not it)."""
    by_layer: dict[str | None, set[str]] = {}
    for name in names:
        pattern, layer = pattern_of(name)
        by_layer.setdefault(layer, set()).add(pattern)
    fused = {}
    for layer, patterns in by_layer.items():
        if FUSED_EXPERTS in patterns and FUSED_EXPERTS not in arch.experts:
            fused[FUSED_EXPERTS.format(i=layer)] = "--fuse-gate-up-exps"
        if {FUSED_QKV, ATTENTION_OUTPUT} <= patterns and SEPARATE_Q not in patterns and SEPARATE_Q in arch.tensors:
            fused |= {p.format(i=layer): "--fuse-qkv" for p in (FUSED_QKV, FUSED_QKV_BIAS) if p in patterns}
    return fused


def pattern_of(gguf_name: str) -> tuple[str, str | None]:
    """'blk.7.attn_q.weight' → ('blk.{i}.attn_q.weight', '7'); other names pass unchanged."""
    match = _LAYER.match(gguf_name)
    if match is None:
        return gguf_name, None
    return "blk.{i}." + gguf_name[match.end() :], match.group(1)


def unpermute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute`: per head, rows (pairs interleaved) → (first halves, second halves).

    Works on dequantized weights, biases, and raw block rows alike (it only moves whole rows).
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
