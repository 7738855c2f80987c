"""DeepSeek V4: hyper-connected residual streams, compressed attention, hash / top-k mixture of experts.

embed → hc_mult copies of it (the streams) → N × [mHC collapse → RMSNorm → attention (sliding window +
CSA / HCA entries) → mHC expand; mHC collapse → RMSNorm → MoE (routed + shared experts) → mHC expand]
→ mHC head → RMSNorm → LM head. Parameter names follow transformers' DeepseekV4ForCausalLM, with the
shared expert's gate/up stacked (weights.py maps the checkpoint's names onto them). Norms,
hyper-connections, sinks, position biases and the router's correction bias stay float32 in a bfloat16
model, as transformers' `_keep_in_fp32_modules_strict` keeps them.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.models.deepseek_v4.attention import DeepseekV4Attention
from llmpipe.models.deepseek_v4.hyper_connection import HyperConnection, HyperHead
from llmpipe.models.deepseek_v4.moe import DeepseekV4MoE
from llmpipe.layers.norm import Float32RMSNorm
from llmpipe.layers.rotary import InterleavedRotaryEmbedding
from llmpipe.models.causal_lm import CausalLM
from llmpipe.models.deepseek_v4.weights import load_deepseek_v4_weights, locate
from llmpipe.quant.formats import QuantizedWeight

# Kept in float32: parameters whose name contains one of these (transformers matches them the same way).
KEEP_FLOAT32 = re.compile("|".join((
    "attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias",
    "q_a_norm", "kv_norm", "input_layernorm", "post_attention_layernorm", "norm",
)))


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = DeepseekV4Attention(cfg, layer)
        self.mlp = DeepseekV4MoE(cfg, layer)
        self.input_layernorm = Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(self, streams, input_ids, positions, ropes, kv_cache, meta) -> torch.Tensor:
        """streams: [T, hc_mult, hidden] → the same, after attention and the MoE."""
        post, comb, x = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(x), positions, ropes, kv_cache, meta)
        streams = HyperConnection.expand(out, post, comb, streams)
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.expand(self.mlp(self.post_attention_layernorm(x), input_ids), post, comb, streams)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v4 = cfg.extra
        self.hc_mult = v4.hc_mult
        # An empty weight skips nn.Embedding's random init (see llama.py).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperHead(cfg)
        self.norm = Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        max_len = cfg.max_position_embeddings
        self.rotary = InterleavedRotaryEmbedding(v4.rope_head_dim, max_len, cfg.rope_theta, None)  # window-only layers
        self.rotary_compress = InterleavedRotaryEmbedding(
            v4.rope_head_dim, max_len, v4.compress_rope_theta, v4.compress_rope_scaling
        )

    def forward(self, input_ids, positions, kv_caches: list, metas: list) -> torch.Tensor:
        """input_ids, positions: [T] (sequences concatenated) → hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(-2).expand(-1, self.hc_mult, -1).contiguous()
        ropes = (self.rotary, self.rotary_compress)
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
            streams = layer(streams, input_ids, positions, ropes, kv_cache, meta)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(CausalLM):
    """V4's body, checkpoint names and float32 parameters behind the shared LM head."""

    model_class = DeepseekV4Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        load_deepseek_v4_weights(self, weights)

    @staticmethod
    def target_of(name: str) -> str:
        return locate(name)[0]

    def _apply(self, fn, recurse=True):
        """Any conversion (model.to(dtype) included) leaves the KEEP_FLOAT32 parameters in float32."""
        super()._apply(fn, recurse)
        for name, param in self.named_parameters():
            if param.is_floating_point() and param.dtype != torch.float32 and KEEP_FLOAT32.search(name):
                param.data = param.data.float()
        return self

