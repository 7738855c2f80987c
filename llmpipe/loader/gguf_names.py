"""GGUF tensor names → Hugging Face Llama names: one table per GGUF architecture.

llama.cpp's converter permutes the rows of attn_q / attn_k (weight and bias) for the "llama"
architecture only (its LlamaModel.modify_tensors; Qwen2Model and Qwen3Model do not), turning
Hugging Face's rotate-half RoPE layout into interleaved pairs. `permuted` names the tensors whose
rows must be put back, with the ModelConfig field that gives their head count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmpipe.errors import UnsupportedModelError

_LAYER = re.compile(r"^blk\.(\d+)\.")

_LLAMA_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_QKV_BIAS = {
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
}
_QK_NORM = {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
_GEMMA3_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
} | _QK_NORM
_LLAMA_PERMUTED = {
    "blk.{i}.attn_q.weight": "num_attention_heads",
    "blk.{i}.attn_q.bias": "num_attention_heads",
    "blk.{i}.attn_k.weight": "num_key_value_heads",
    "blk.{i}.attn_k.bias": "num_key_value_heads",
}


@dataclass(frozen=True)
class GGUFArchitecture:
    tensors: dict[str, str]  # GGUF name pattern → Hugging Face name pattern ({i} = layer)
    permuted: dict[str, str] = field(default_factory=dict)  # GGUF pattern → head-count field
    # Gemma's RMSNorm scales by (1 + weight); llama.cpp's converter stores 1 + weight, so loading subtracts it.
    norms_store_one_plus_weight: bool = False

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor, or None for tensors the model does not load."""
        pattern, layer = pattern_of(gguf_name)
        hf_pattern = self.tensors.get(pattern)
        return None if hf_pattern is None else hf_pattern.format(i=layer)


GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    # SmolLM2, Llama 2/3 and Mistral GGUFs all say "llama".
    "llama": GGUFArchitecture(tensors=_LLAMA_TENSORS | _QKV_BIAS, permuted=_LLAMA_PERMUTED),
    "qwen2": GGUFArchitecture(tensors=_LLAMA_TENSORS | _QKV_BIAS),
    "qwen3": GGUFArchitecture(tensors=_LLAMA_TENSORS | _QK_NORM),
    "gemma3": GGUFArchitecture(tensors=_GEMMA3_TENSORS, norms_store_one_plus_weight=True),
}


def gguf_architecture(name: str, path: Path) -> GGUFArchitecture:
    if name not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {name!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    return GGUF_ARCHITECTURES[name]


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
