"""Qwen2-MoE and Qwen3-MoE: Qwen2's attention (qkv bias) or Qwen3's (q/k RMSNorm), RoPE, GQA, with a
mixture of experts in place of the MLP: a softmax router picks each token's top-k of num_experts SwiGLU
experts (moe_intermediate_size wide), weighted by their probabilities (renormalized over the k where
norm_topk_prob); Qwen2-MoE adds an always-on shared expert, scaled by sigmoid(shared_expert_gate · x).
Layers listed as dense keep Llama's MLP."""

from __future__ import annotations

import torch
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.layers.moe import Experts, SoftmaxTopKRouter
from llmpipe.models.llama.model import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.extra
        self.gate = SoftmaxTopKRouter(cfg.hidden_size, moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob)
        self.experts = Experts(LlamaMLP(cfg, moe.moe_intermediate_size) for _ in range(moe.num_experts))
        if moe.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)  # one row: kept float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Qwen3MoeModel(LlamaModel):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, Qwen3MoeSparseBlock(cfg) if cfg.extra.sparse_layers[layer] else None)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_class = Qwen3MoeModel
