"""Gemma 3 as a bidirectional encoder (EmbeddingGemma): config.json's `gemma3_text` with
`use_bidirectional_attention: true`, run over a right-padded batch without a KV cache.

The math is Gemma 3's: embed × √hidden → N × [RMSNorm → attention (q/k RMSNorm, RoPE — the local
base on sliding layers — scores × query_pre_attn_scalar^-1/2, GQA) → RMSNorm → residual → RMSNorm →
GeGLU (tanh) FFN → RMSNorm → residual] → RMSNorm, every RMSNorm scaling by (1 + weight). But every
token attends to every real token of its sequence; a sliding layer only to those within
sliding_window // 2 positions on either side (config.json's value: transformers halves it on load into
an exclusive bound, `|q - k| < sliding_window // 2 + 1`). Parameter names are Gemma3TextModel's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.layers.norm import RMSNorm
from llmpipe.layers.rotary import RotaryEmbedding, apply_rotary

SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATION = "gelu_pytorch_tanh"


def encoder_config(cfg: dict[str, Any], config: ModelConfig, path: Path) -> ModelConfig:
    """The encoder's config: the checkpoint's ModelConfig, read as for the decoder (loader/hf_config.py: the same
    fields, soft-capping refused there), once what the encoder does not run is refused. `cfg`: its config.json."""
    if cfg.get("model_type") != "gemma3_text" or not cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{path}: not a bidirectional Gemma 3 (gemma3_text with use_bidirectional_attention)")
    if cfg.get("hidden_activation", ACTIVATION) != ACTIVATION:
        raise UnsupportedModelError(f"{path}: hidden_activation {cfg['hidden_activation']!r} is not supported ({ACTIVATION})")
    if set(config.layer_types or ()) - {SLIDING, FULL}:
        raise UnsupportedModelError(f"{path}: layer_types {sorted(set(config.layer_types or ()))} (known: {SLIDING}, {FULL})")
    return replace(config, sliding_window=config.sliding_window or 4096)  # Gemma3TextConfig's default


class Gemma3BidirectionalAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.scale = cfg.query_pre_attn_scalar**-0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H], rope's cos/sin [T, 1, head_dim], mask [B, 1, T, T] (True: may attend) → [B, T, H]."""
        q = apply_rotary(self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))), *rope)
        k = apply_rotary(self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))), *rope)
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=self.scale, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma3BidirectionalAttention(cfg)
        self.mlp = Gemma3MLP(cfg)
        self.layer_type = cfg.layer_types[layer]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Encoder(nn.Module):
    """Token ids [B, T] → hidden states [B, T, H] after the final norm; padded positions hold values no one should read."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3EncoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        max_len = cfg.max_position_embeddings
        self.rotary = nn.ModuleDict({FULL: RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling),
                                     SLIDING: RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_local_theta, None)})
        self.embed_scale = cfg.hidden_size**0.5
        self.sliding_window = cfg.sliding_window

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """valid [B, T]: True on real tokens (right padding: a sequence's positions are 0, 1, …)."""
        x = self.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=torch.float32)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        ropes = {kind: rotary.tables(positions, x.dtype) for kind, rotary in self.rotary.items()}
        masks = self.attention_masks(valid)
        for layer in self.layers:
            x = layer(x, ropes[layer.layer_type], masks[layer.layer_type])
        return self.norm(x)

    def attention_masks(self, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """[B, 1, T, T] per layer type: the real keys, and on sliding layers only those within the window."""
        keys = valid[:, None, None, :]
        positions = torch.arange(valid.shape[1], device=valid.device)
        near = (positions[:, None] - positions[None, :]).abs() <= self.sliding_window // 2
        return {FULL: keys, SLIDING: keys & near}
