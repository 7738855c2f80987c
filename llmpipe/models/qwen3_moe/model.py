"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm, RoPE, GQA) with a mixture of experts in place of the MLP:
a softmax router picks each token's top-k of num_experts SwiGLU experts (moe_intermediate_size wide),
weighted by their probabilities (renormalized over the k where norm_topk_prob). Layers listed as dense
keep Llama's MLP."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x))


class Qwen3MoeModel(LlamaModel):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, Qwen3MoeSparseBlock(cfg) if cfg.extra.sparse_layers[layer] else None)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_class = Qwen3MoeModel
