"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM2.

embed → N × [RMSNorm → attention (RoPE, GQA, KV cache) → residual → RMSNorm → SwiGLU FFN → residual]
→ RMSNorm → LM head. Parameter names follow Hugging Face, with q/k/v and gate/up stacked into one
matrix each (one matmul instead of three / two per layer on the decode path).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.kv_cache.kinds import KVCacheSpec, attention_spec
from llmpipe.layers import attention_kernel
from llmpipe.layers.activation import ACTIVATIONS
from llmpipe.layers.attention import AttentionMetadata, paged_attention
from llmpipe.layers.linear import Linear
from llmpipe.layers.norm import RMSNorm
from llmpipe.layers.rotary import RotaryEmbedding, rotate_heads_
from llmpipe.layers.rows import row_slices, stack_rows
from llmpipe.models.causal_lm import CausalLM
from llmpipe.models.llama.decode_step import FusedDecodeBody
from llmpipe.models.weights import load_weights, target_of
from llmpipe.quant.formats import QuantizedWeight

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin at this forward's positions
# A large step's rows go through the MLP this many at a time, in near-equal parts (each row's result is its own):
# gate_up's 2 × intermediate floats a row are a step's largest activations (a 1B's 2,048-token step: 128 MiB, and
# 0.35 GiB of peak RSS in all), and llama.cpp likewise computes at most 512 tokens at once (its n_ubatch).
MLP_CHUNK_ROWS = 512

# (stacked parameter, checkpoint name part, shard index)
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)



class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.qkv_proj.shard_sizes = (self.q_size, self.kv_size, self.kv_size)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.window = cfg.sliding_window
        self.sinks: torch.Tensor | None = None  # gpt-oss: a learned logit per head in the softmax (layers/attention.py)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        heads = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)  # [T, q heads + k heads + v heads, D]
        if self.q_norm is None and attention_kernel.fused_decode_usable(heads, rope[0], kv_cache, meta):
            # decode: RoPE, the K/V write and attention in one C call (the ops below, ~20 of them)
            out = attention_kernel.rope_write_decode_attention(
                heads, *rope, kv_cache, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                self.num_heads, self.scale, self.window, self.sinks)
            return self.o_proj(out)
        rotated = self.num_heads + self.num_kv_heads
        qk, v = heads[:, :rotated], heads[:, rotated:]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
            rotate_heads_(qk, *rope, rotated)
        else:
            rotate_heads_(heads, *rope, rotated)  # qk is a view of heads: q and k rotated together, in place
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window, self.sinks)
        return self.o_proj(out)

    def kv_cache_spec(self) -> KVCacheSpec:
        return attention_spec(self.window)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, bias: bool = False):
        super().__init__()
        inner = intermediate_size or cfg.intermediate_size  # an expert's is its own (moe_intermediate_size)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inner, bias=bias)
        self.gate_up_proj.shard_sizes = (inner, inner)
        self.down_proj = Linear(inner, cfg.hidden_size, bias=bias)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= MLP_CHUNK_ROWS or self.gate_up_proj._forward_hooks or self.down_proj._forward_hooks:
            return self.gated(x)  # hooks (LoRA's per-row deltas) see the step's rows whole
        return stack_rows(x.shape[0], ((rows, self.gated(x[rows])) for rows in row_slices(x.shape[0], MLP_CHUNK_ROWS)))

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        product = self.glu(*self.gate_up_proj(x).chunk(2, dim=-1))  # gate_up's output freed before down runs
        return self.down_proj(product)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated unit between the two projections: act(gate) · up."""
        return self.act(gate).mul_(up)  # in place: the activation's output is a fresh tensor


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg) if mlp is None else mlp  # a mixture of experts' sparse block, in place of the dense one

    def forward(self, x, rope, kv_cache, meta):
        h = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)  # x is the caller's: left as it is
        return h.add_(self.mlp(self.post_attention_layernorm(h)))  # h is this layer's own: one [T, hidden] fewer

    def decode_step_norms(self) -> tuple[nn.Module, nn.Module, None, None]:
        """For the fused step: the norms before attention and before the MLP; none on their outputs."""
        return self.input_layernorm, self.post_attention_layernorm, None, None

    def decode_step_rope(self) -> int:
        """For the fused step: which of the body's RoPE tables this layer takes (Llama has one)."""
        return 0


class LlamaModel(FusedDecodeBody, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Given an empty weight (the checkpoint fills it), nn.Embedding skips its random init, whose
        # first call on the meta device imports torch._dynamo: seconds off every process's first load.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.config = cfg

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return LlamaDecoderLayer(cfg)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        """metas: each layer's attention metadata (layers of one KV cache group share one)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        fused = self.fused_layers(x, [rope], kv_caches, metas)
        if fused is not None:
            return fused
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    model_class: type[nn.Module] = LlamaModel  # Gemma 3 reuses the head and weight loading with its own body

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in, stacking q/k/v and gate/up."""
        load_weights(self, weights, STACKED_PARAMS, self.config.tie_word_embeddings)

    @staticmethod
    def target_of(name: str) -> str:
        return target_of(name, STACKED_PARAMS)[0]
