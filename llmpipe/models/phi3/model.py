"""Phi-3 / Phi-3.5 (and Phi-4-mini's partial RoPE): the Llama body with Phi's checkpoint and RoPE.

The checkpoint already holds q/k/v and gate/up fused (`qkv_proj`, `gate_up_proj`), in the order
Llama's stacked parameters keep them, so the layers are Llama's. RoPE is LongRoPE where configured
(rotary.py), on the first `rotary_dim` channels of each head.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from llmpipe.config import ModelConfig
from llmpipe.distributed.sharding import slice_rows
from llmpipe.layers.attention import AttentionMetadata, paged_attention
from llmpipe.layers.rotary import RotaryEmbedding, apply_rotary
from llmpipe.models.llama.model import STACKED_PARAMS, LlamaAttention, LlamaForCausalLM, LlamaModel, Rope
from llmpipe.models.phi3.rotary import LongRoPE
from llmpipe.models.weights import load_weights
from llmpipe.quant.formats import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Phi3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.rotary_dim = cfg.extra.rotary_dim

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return super().forward(x, rope, kv_cache, meta)
        heads = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)
        qk, v = heads[:, : self.num_heads + self.num_kv_heads], heads[:, self.num_heads + self.num_kv_heads :]
        qk = torch.cat([apply_rotary(qk[..., : self.rotary_dim], *rope), qk[..., self.rotary_dim :]], dim=-1)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(paged_attention(q, k, v, kv_cache, meta, self.scale, self.window))


class Phi3Model(LlamaModel):
    fuses_decode = False  # partial rotary: not the fused step's RoPE
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)  # built on the meta device (models.build_model): replacing parts costs nothing
        for layer in self.layers:
            layer.self_attn = Phi3Attention(cfg)
        rope = LongRoPE if cfg.rope_scaling is not None else RotaryEmbedding
        self.rotary = rope(cfg.extra.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)


class Phi3ForCausalLM(LlamaForCausalLM):
    model_class = Phi3Model

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Fused checkpoint tensors are cut into Llama's shards: quantized layers take their rows shard by shard."""
        load_weights(self, self._unfused(weights), STACKED_PARAMS, self.config.tie_word_embeddings)

    def _unfused(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        for name, tensor in weights:
            module_name, _, kind = name.rpartition(".")
            parent, _, fused = module_name.rpartition(".")
            if fused not in FUSED:
                yield name, tensor
                continue
            start = 0
            for part, rows in zip(FUSED[fused], self.get_submodule(module_name).shard_sizes):
                yield f"{parent}.{part}.{kind}", slice_rows(tensor, range(start, start + rows))
                start += rows

    @staticmethod
    def target_of(name: str) -> str:
        return name  # checkpoint names are the parameters' (qkv_proj, gate_up_proj)
