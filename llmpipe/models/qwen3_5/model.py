"""Qwen3.5 (dense, text): linear-attention layers (Gated DeltaNet) and gated full-attention layers, per layer_types.

embed → N × [norm → mixer → residual → norm → SwiGLU MLP → residual] → norm → LM head, every norm zero-centred
(x / rms(x) × (1 + weight), in float32); Qwen3.5-MoE and Qwen3-Next put Qwen3-MoE's sparse block in place of the MLP
(their extra fields' `moe` says on which layers). The mixer is one of:

- Gated DeltaNet (three layers in four in the released models): q, k, v from a depthwise causal conv (SiLU) over
  one projection, then the delta-rule recurrence over a fixed-size state per value head (layers/gated_delta.py);
  its output is RMS-normed and gated by silu(z) before out_proj. A sequence's conv and SSM states live in the
  recurrent state pool (kv_cache/kinds/recurrent.py): decode rows update their slot in place, prefill chunks
  continue from theirs (or from zeros for a sequence's first chunk), and a checkpoint of the state may be copied
  out partway through a chunk.
- full attention: Qwen3's (GQA over the paged K/V cache, q/k RMSNorm per head), RoPE on the first
  `partial_rotary_factor` of each head's channels, and an output gate: q_proj emits per head [q | gate], and the
  attention output is scaled by sigmoid(gate) before o_proj.

Parameter names follow Hugging Face, with q/k/v, gate/up and the linear layers' four input projections
(qkv / z / b / a) stacked into one matrix each: one matmul instead of several per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.kernels import ops
from llmpipe.kv_cache.kinds import KVCacheSpec, attention_spec
from llmpipe.kv_cache.kinds.recurrent import RecurrentMetadata, RecurrentState, RecurrentStateSpec, StateChunk
from llmpipe.layers.attention import AttentionMetadata, paged_attention
from llmpipe.layers.gated_delta import (causal_conv1d, causal_conv1d_step, decay_and_beta, expand_heads,
                                        gated_delta_chunked, gated_delta_step, gated_rms_norm, normalize_qk)
from llmpipe.layers.linear import Linear
from llmpipe.layers.norm import RMSNorm
from llmpipe.layers.rotary import RotaryEmbedding, apply_rotary
from llmpipe.models.causal_lm import CausalLM
from llmpipe.models.llama.model import STACKED_PARAMS as LLAMA_STACKED
from llmpipe.models.llama.model import LlamaMLP, Rope
from llmpipe.models.qwen3_moe.model import Qwen3MoeSparseBlock
from llmpipe.models.weights import load_weights, target_of
from llmpipe.quant.formats import QuantizedWeight

STACKED_PARAMS = LLAMA_STACKED + (
    ("in_proj", "in_proj_qkv", 0),
    ("in_proj", "in_proj_z", 1),
    ("in_proj", "in_proj_b", 2),
    ("in_proj", "in_proj_a", 3),
)
LINEAR_ATTENTION = "linear_attention"

Heads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k [tokens, v heads, k_dim] (normalized); v [tokens, v heads, v_dim]


class GatedRMSNorm(nn.Module):
    """weight × rmsnorm(x) × silu(gate) per value head (no 1 + weight offset here, unlike the model's other norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class Qwen35GatedDeltaNet(nn.Module):
    """The linear-attention mixer over a step's rows: decode rows first (one token each), then prefill chunks."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        f = cfg.extra
        self.num_k_heads, self.num_v_heads = f.linear_num_key_heads, f.linear_num_value_heads
        self.k_dim, self.v_dim = f.linear_key_head_dim, f.linear_value_head_dim
        self.tiled = f.v_heads_tiled  # which value heads a key head serves (expand_heads)
        self.key_size, self.value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size  # the conv runs over q, k and v together
        self.in_proj = Linear(cfg.hidden_size, self.conv_dim + self.value_size + 2 * self.num_v_heads, bias=False)
        self.in_proj.shard_sizes = (self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads)  # qkv, z, b, a
        kernel = f.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))  # per head: log of the decay rate's scale
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: RecurrentState, meta: RecurrentMetadata) -> torch.Tensor:
        proj = self.in_proj(x)
        decodes = meta.num_decodes
        parts = [self._decode(proj[:decodes], state, meta.decode_slots)] if decodes else []
        for slot, copy_to in meta.decode_snapshots:
            state.copy(slot, copy_to)
        if meta.chunks:
            parts.append(self._prefill_rows(proj[decodes:], state, meta.chunks, decodes))
        return self.out_proj(parts[0] if len(parts) == 1 else torch.cat(parts))

    def _decode(self, proj: torch.Tensor, state: RecurrentState, slots: torch.Tensor) -> torch.Tensor:
        """One token for each decode row → the normed, gated output [rows, value_size]. On the CPU in float32 one C
        call does it all, the conv and SSM states updated where they sit in the pool. Otherwise the conv states (a few
        rows each) are gathered, stepped and written back; the SSM states are updated in place by the C step on the
        CPU (each read and written once), or gathered and scattered around the PyTorch step."""
        if self._c_decode(proj, state):
            return ops.gated_delta_decode(proj.contiguous(), self.conv1d.weight[:, 0], self.conv1d.bias, self.A_log,
                                          self.dt_bias, self.norm.weight, state.conv, state.ssm, slots,
                                          self.num_k_heads, self.norm.eps, self.tiled)
        qkv, z, g, beta = self._split(proj)
        conv = state.conv[slots]
        mixed = causal_conv1d_step(qkv, self.conv1d.weight[:, 0], self.conv1d.bias, conv)
        state.conv[slots] = conv
        q, k, v = self._heads(mixed)
        if state.ssm.device.type == "cpu" and ops.available():
            out = ops.gated_delta_step(q, k, v.float().contiguous(), g, beta.float(), state.ssm, slots).to(v.dtype)
        else:
            ssm = state.ssm[slots]
            out = gated_delta_step(q, k, v, g, beta, ssm)
            state.ssm[slots] = ssm
        return self.norm(out, z).flatten(-2)

    def _c_decode(self, proj: torch.Tensor, state: RecurrentState) -> bool:
        tensors = (proj, self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, state.conv, state.ssm)
        return (state.ssm.device.type == "cpu" and all(t.dtype == torch.float32 for t in tensors)
                and self.v_dim <= ops.GATED_DELTA_MAX_V_DIM and ops.available())

    def _prefill_rows(self, proj: torch.Tensor, state: RecurrentState, chunks: list[StateChunk], first: int) -> torch.Tensor:
        """The prefill chunks' rows (from step row `first` on) → the normed, gated output [rows, value_size]."""
        qkv, z, g, beta = self._split(proj)
        out = proj.new_empty(proj.shape[0], self.num_v_heads, self.v_dim)
        for chunk in chunks:
            rows = slice(chunk.rows[0] - first, chunk.rows[1] - first)
            out[rows] = self._prefill(qkv[rows], g[rows], beta[rows], state, chunk)
        return self.norm(out, z).flatten(-2)

    def _split(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """in_proj's rows → qkv, z [rows, v heads, v_dim], and the decay g and rate beta [rows, v heads]."""
        qkv, z, b, a = proj.split(self.in_proj.shard_sizes, dim=-1)
        return qkv, z.unflatten(-1, (self.num_v_heads, self.v_dim)), *decay_and_beta(a, b, self.A_log, self.dt_bias)

    def _prefill(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: RecurrentState,
                 chunk: StateChunk) -> torch.Tensor:
        """One sequence's chunk, continuing from its slot's state (zeros for a first chunk, whatever the slot held);
        a snapshot splits it in two scans, the state between them copied out (a prefix-cache checkpoint)."""
        conv, ssm = _start(state, chunk)
        cut = len(qkv) if chunk.snapshot is None else chunk.snapshot[0]
        head, conv, ssm = self._scan(qkv[:cut], g[:cut], beta[:cut], conv, ssm)
        if chunk.snapshot is not None:
            _store(state, chunk.snapshot[1], conv, ssm)
        tail, conv, ssm = self._scan(qkv[cut:], g[cut:], beta[cut:], conv, ssm)
        _store(state, chunk.slot, conv, ssm)
        return torch.cat([head, tail])

    def _scan(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv: torch.Tensor,
              ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv and chunked recurrence over consecutive tokens of one sequence → (out, conv state, SSM state)."""
        if not len(qkv):
            return qkv.new_empty(0, self.num_v_heads, self.v_dim), conv, ssm
        mixed, conv = causal_conv1d(qkv, self.conv1d.weight[:, 0], self.conv1d.bias, conv)
        out, ssm = gated_delta_chunked(*self._heads(mixed), g, beta, ssm)
        return out, conv, ssm

    def _heads(self, mixed: torch.Tensor) -> Heads:
        """The conv's output → q and k (one head per value head, l2-normalized, q scaled) and v."""
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q, k = (expand_heads(t.unflatten(-1, (self.num_k_heads, self.k_dim)), self.num_v_heads, self.tiled) for t in (q, k))
        return *normalize_qk(q, k), v.unflatten(-1, (self.num_v_heads, self.v_dim))

    def kv_cache_spec(self) -> KVCacheSpec:
        kernel = self.conv1d.kernel_size[0]
        return RecurrentStateSpec(conv_shape=(self.conv_dim, kernel - 1), ssm_shape=(self.num_v_heads, self.k_dim, self.v_dim))


def _start(state: RecurrentState, chunk: StateChunk) -> tuple[torch.Tensor, torch.Tensor]:
    """The states a chunk continues from: its slot's, or zeros where it starts the sequence (the slot is stale)."""
    conv, ssm = state.conv[chunk.slot], state.ssm[chunk.slot]
    return (torch.zeros_like(conv), torch.zeros_like(ssm)) if chunk.fresh else (conv, ssm)


def _store(state: RecurrentState, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
    state.conv[slot], state.ssm[slot] = conv, ssm


class Qwen35Attention(nn.Module):
    """Gated full attention: Qwen3's attention with partial RoPE and sigmoid(gate) on its output."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.qkv_proj.shard_sizes = (2 * self.q_size, self.kv_size, self.kv_size)  # q_proj: per head [q | gate]
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.rotary_dim = cfg.extra.rotary_dim(self.head_dim)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q, gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self._rotate(self.q_norm(q), rope)
        k = self._rotate(self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim)), rope)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))

    def _rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """RoPE on the first rotary_dim channels of each head; the rest pass unturned."""
        return torch.cat([apply_rotary(x[..., : self.rotary_dim], *rope), x[..., self.rotary_dim :]], dim=-1)

    def kv_cache_spec(self) -> KVCacheSpec:
        return attention_spec(None)


class Qwen35DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.linear = cfg.layer_types[layer] == LINEAR_ATTENTION
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        if self.linear:
            self.linear_attn = Qwen35GatedDeltaNet(cfg)
        else:
            self.self_attn = Qwen35Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.mlp = _mlp(cfg, layer)

    def forward(self, x: torch.Tensor, rope: Rope, cache: RecurrentState | torch.Tensor,
                meta: RecurrentMetadata | AttentionMetadata) -> torch.Tensor:
        """cache, meta: the layer's recurrent states and their metadata, or its K/V cache and attention metadata."""
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, cache, meta) if self.linear else self.self_attn(h, rope, cache, meta))
        return x + self.mlp(self.post_attention_layernorm(x))


def _mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """The SwiGLU MLP, or a mixture of experts where the config gives the layer one (Qwen3.5-MoE, Qwen3-Next: the
    extra fields' `moe`, read by Qwen3-MoE's block as its own config's)."""
    moe = getattr(cfg.extra, "moe", None)
    if moe is None or not moe.sparse_layers[layer]:
        return LlamaMLP(cfg)
    return Qwen3MoeSparseBlock(dataclasses.replace(cfg, extra=moe))


class Qwen35Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # An empty weight skips nn.Embedding's random init (LlamaModel's note).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Qwen35DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        rotary_dim = cfg.extra.rotary_dim(cfg.head_dim)
        self.rotary = RotaryEmbedding(rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.config = cfg

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, metas: list) -> torch.Tensor:
        """kv_caches, metas: per layer, its RecurrentState and RecurrentMetadata (linear attention) or its K/V cache
        and AttentionMetadata (full attention)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        for layer, cache, meta in zip(self.layers, kv_caches, metas):
            x = layer(x, rope, cache, meta)
        return self.norm(x)


class Qwen35ForCausalLM(CausalLM):
    model_class = Qwen35Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in, stacking the projections (STACKED_PARAMS)."""
        load_weights(self, weights, STACKED_PARAMS, self.config.tie_word_embeddings)

    @staticmethod
    def target_of(name: str) -> str:
        return target_of(name, STACKED_PARAMS)[0]
