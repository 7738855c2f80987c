"""gpt-oss (gpt-oss-20b, gpt-oss-120b): Llama's skeleton with OpenAI's choices.

embed → N × [RMSNorm → attention (q/k/v/o biases, RoPE (YaRN), GQA, a sink logit per head; sliding
window of 128 on even layers) → residual → RMSNorm → mixture of experts → residual] → RMSNorm → LM head.

The router (with a bias) takes each token's top-k experts by logit and softmaxes over those k. Each expert
is a biased gated MLP with the clamped SwiGLU: gate ≤ limit, |up| ≤ limit, out = gate·σ(α·gate)·(up + 1).
"""

from __future__ import annotations

import torch
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.layers.linear import Linear
from llmpipe.layers.moe import Experts, SoftmaxTopKRouter
from llmpipe.models.llama.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class GptOssAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.window = cfg.layer_window(layer)
        self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads))


class GptOssExpert(LlamaMLP):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, cfg.intermediate_size, bias=True)
        self.alpha, self.limit = cfg.extra.swiglu_alpha, cfg.extra.swiglu_limit

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


class GptOssSparseBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.extra
        # Top-k of the logits, then a softmax over them: the same weights as a softmax renormalized over its top k.
        self.router = SoftmaxTopKRouter(cfg.hidden_size, moe.num_experts, moe.num_experts_per_tok, True, bias=True)
        self.experts = Experts(GptOssExpert(cfg) for _ in range(moe.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.router(x))


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, GptOssSparseBlock(cfg))
        self.self_attn = GptOssAttention(cfg, layer)


class GptOssModel(LlamaModel):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return GptOssDecoderLayer(cfg, layer)


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel
