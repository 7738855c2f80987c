"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM2.

embed → N × [RMSNorm → attention (RoPE, GQA, KV cache) → residual → RMSNorm → SwiGLU FFN → residual]
→ RMSNorm → LM head. Parameter names follow Hugging Face, with q/k/v and gate/up stacked into one
matrix each (one matmul instead of three / two per layer on the decode path).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.errors import ModelLoadError
from llmpipe.layers.attention import AttentionMetadata, paged_attention
from llmpipe.layers.linear import Linear, linear
from llmpipe.layers.norm import RMSNorm
from llmpipe.layers.rotary import RotaryEmbedding, apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin at this forward's positions

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

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        heads = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)  # [T, q heads + k heads + v heads, D]
        qk, v = heads[:, : self.num_heads + self.num_kv_heads], heads[:, self.num_heads + self.num_kv_heads :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        q, k = apply_rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)  # q and k rotated together
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.gate_up_proj.shard_sizes = (cfg.intermediate_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        tied = cfg.tie_word_embeddings
        self.lm_head = None if tied else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.splits = torch.get_num_threads()

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Hidden states [T, hidden] of the new tokens."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return linear(hidden, self.model.embed_tokens.weight, splits=self.splits)
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, stacking q/k/v and gate/up."""
        params = dict(self.named_parameters())
        expected = self._expected_checkpoint_names(params)
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still carry a copy of the embedding
            target, shard = self._target_of(name)
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the {self.config.architecture} model")
            self._copy_into(params[target], tensor, shard, name)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[0]!r}")

    def _expected_checkpoint_names(self, params: dict[str, nn.Parameter]) -> set[str]:
        names = set()
        for name in params:
            parts = [name.replace(f".{full}.", f".{part}.") for full, part, _ in STACKED_PARAMS if f".{full}." in name]
            names.update(parts or [name])
        return names

    @staticmethod
    def _target_of(name: str) -> tuple[str, int | None]:
        for full, part, shard in STACKED_PARAMS:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{full}."), shard
        return name, None

    def _copy_into(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None, name: str) -> None:
        dest = param.data
        if shard is not None:
            module = self.get_submodule(self._target_of(name)[0].rsplit(".", 1)[0])
            sizes = module.shard_sizes
            offset = sum(sizes[:shard])
            dest = dest.narrow(0, offset, sizes[shard])
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}")
        dest.copy_(tensor)
