"""Gemma 3 (text): Llama's skeleton with Gemma's choices.

embed × √hidden → N × [RMSNorm → attention (q/k RMSNorm, RoPE, GQA; sliding window on local layers)
→ RMSNorm → residual → RMSNorm → GeGLU FFN → RMSNorm → residual] → RMSNorm → tied LM head
(→ tanh soft-cap where configured). Every RMSNorm scales by (1 + weight). Local (sliding-window)
layers and global ones use different RoPE bases; attention scores are scaled by
query_pre_attn_scalar^-1/2. Parameter names follow Hugging Face, q/k/v and gate/up stacked.
"""

from __future__ import annotations

import torch
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.layers.attention import AttentionMetadata
from llmpipe.layers.norm import RMSNorm
from llmpipe.layers.rotary import RotaryEmbedding
from llmpipe.models.llama.decode_step import FusedDecodeBody
from llmpipe.models.llama.model import LlamaAttention, LlamaForCausalLM, LlamaMLP, Rope


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg)  # q/k norms exist: the loaders set qk_norm for Gemma 3
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.window = cfg.layer_window(layer)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma3Attention(cfg, layer)
        self.mlp = LlamaMLP(cfg)  # GELU-tanh: the config's hidden_act
        # Local layers take the local RoPE base even when their window is disabled (disable_sliding_window).
        self.is_local = cfg.layer_types is not None and cfg.layer_types[layer] == "sliding_attention"

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def decode_step_norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm]:
        """For the fused step: the norms before attention and before the MLP, then on their outputs."""
        return (self.input_layernorm, self.pre_feedforward_layernorm, self.post_attention_layernorm,
                self.post_feedforward_layernorm)

    def decode_step_rope(self) -> int:
        """For the fused step: the global table (0) or the local one (1), as `forward`'s ropes[is_local]."""
        return int(self.is_local)


class Gemma3Model(FusedDecodeBody, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # no init: see llama.py
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_scale = cfg.hidden_size**0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        max_len = cfg.max_position_embeddings
        self.rotary = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling)  # global layers
        local_theta = cfg.rope_local_theta or cfg.rope_theta
        self.rotary_local = RotaryEmbedding(cfg.head_dim, max_len, local_theta, None)
        self.config = cfg

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # √hidden rounded to the activation dtype first, as transformers does (55.5, not 55.43, in bf16).
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        ropes = (self.rotary.tables(positions, x.dtype), self.rotary_local.tables(positions, x.dtype))
        fused = self.fused_layers(x, list(ropes), kv_caches, metas)
        if fused is not None:
            return fused
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
            x = layer(x, ropes[layer.is_local], kv_cache, meta)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Weight loading and the (tied) LM head come from the Llama family; the body is Gemma's."""

    model_class = Gemma3Model

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.softcap = cfg.final_logit_softcapping

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap
