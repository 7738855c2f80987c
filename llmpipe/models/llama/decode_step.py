"""A Llama-family decode step in one C call (kernels/csrc/decode_step.c), the torch op `llmpipe::decode_step`
(kernels/csrc/ops.cpp).

At batch 1 a decode step is ~7 small matrix-vector products per layer plus norms, RoPE and
attention: run as one PyTorch or kernel op call each, with Python between them, the calls cost more
than streaming the weights (issue 17's profile: ~3,200 ATen ops per token). The kernel runs every
layer of a decode-only batch (up to MAX_BATCH rows) in one OpenMP region; the embedding, the final
norm and the LM head stay in PyTorch (one call each).

Each linear keeps its own numerics: float activations into the exact low-bit row kernels (bit for
bit the per-op kernels' results), or 8- or 16-bit activation blocks where the layer has
`activation_bits` set. The layer-by-layer path stays for everything else — prefill, mixed batches, other caches,
other families — and is what this step is tested against.
"""

from __future__ import annotations

import torch
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.kernels.build import library as _library
from llmpipe.layers.attention import AttentionMetadata
from llmpipe.layers.linear import Linear
from llmpipe.layers.norm import RMSNorm
from llmpipe.quant.linear import FLOAT_BATCH_MIN_ROWS, KERNEL_MAX_BATCH, Int4Linear, Int8Linear

MAX_ROWS = 8  # csrc MAX_ROWS: the row kernels' widest run (larger batches go MAX_ROWS rows at a time)
# Batches up to this many rows take the step: quantized weights as far as their per-op kernels go
# (above it, dequantizing once for a GEMM wins); float32 weights only up to MAX_ROWS, beyond which
# MKL's GEMM, reading each weight once for every row, beats re-reading them per run of MAX_ROWS.
MAX_BATCH = KERNEL_MAX_BATCH
F32, INT4, INT8 = 0, 1, 2
LINEAR_SLOTS = 9  # csrc LinearDesc: kind, bits, weight, scale, offset, bias, N, K, group


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def linear_slots(module: nn.Module) -> list[int] | None:
    """A linear's LinearDesc, or None where the kernel does not take its kind of weight."""
    bias = getattr(module, "bias", None)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    if type(module) is Linear:
        w = module.weight
        if w.dtype != torch.float32 or not w.is_contiguous() or w.shape[1] % 16:
            return None
        return [F32, 0, w.data_ptr(), 0, 0, _ptr(bias), w.shape[0], w.shape[1], w.shape[1]]
    if not isinstance(module, (Int4Linear, Int8Linear)) or module.padded_in != module.in_features:
        return None
    bits = module.activation_bits or 0
    if isinstance(module, Int4Linear):
        if module.in_perm is not None:
            return None
        return [INT4, bits, module.codes.data_ptr(), module.scale.data_ptr(), module.offset.data_ptr(), _ptr(bias),
                module.out_features, module.in_features, module.group_size]
    return [INT8, bits, module.q.data_ptr(), module.scale.data_ptr(), 0, _ptr(bias), module.out_features,
            module.in_features, module.group_size]


def _plain_norm(norm: nn.Module, eps: float) -> bool:
    return (type(norm) is RMSNorm and not norm.unit_offset and norm.eps == eps and norm.weight.dtype == torch.float32
            and norm.weight.is_contiguous())


class LlamaDecodeStep:
    """Every layer of a Llama body for one decode-only batch. `build` returns None for a body the
    kernel does not run (another family, q/k norms, a GELU MLP, bfloat16, sharded or act-order
    weights, no compiler); `batch_fits` and `takes` say per step whether the batch and cache do."""

    def __init__(self, cfg: ModelConfig, scale: float, layer_slots: list[list[int]], tensors: list[torch.Tensor],
                 float_copies: bool = False):
        self.tensors = tensors  # every tensor whose address layer_slots holds, kept alive with them
        has_float = any(slots[2 + LINEAR_SLOTS * i] == F32 for slots in layer_slots for i in range(4))
        self.max_batch = MAX_ROWS if has_float else MAX_BATCH
        if float_copies:  # from FLOAT_BATCH_MIN_ROWS rows the layers' float copies are faster
            self.max_batch = min(self.max_batch, FLOAT_BATCH_MIN_ROWS - 1)
        self.eps, self.window, self.scale = cfg.rms_norm_eps, cfg.sliding_window or 0, scale
        self.shape = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.layer_slots = layer_slots  # LayerDesc per layer, without its cache pointer
        self._caches: list | None = None
        self._descriptors: torch.Tensor | None = None
        self._pool: torch.Tensor | None = None  # the tensor every layer's cache is a view of

    @classmethod
    def build(cls, layers: nn.ModuleList, cfg: ModelConfig) -> LlamaDecodeStep | None:
        """layers: LlamaDecoderLayer's (the weights are read now: build after loading them)."""
        if cfg.hidden_act not in ("silu", "swish") or cfg.qk_norm or cfg.layer_types is not None:
            return None
        descriptors: list[list[int]] = []
        for layer in layers:
            if not (_plain_norm(layer.input_layernorm, cfg.rms_norm_eps) and _plain_norm(layer.post_attention_layernorm, cfg.rms_norm_eps)):
                return None
            attn, mlp = layer.self_attn, layer.mlp
            linears = [linear_slots(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(slots is None for slots in linears):
                return None
            descriptors.append([layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                           *sum(linears, [])])
        if cfg.hidden_size % 8 or cfg.head_dim % 8 or _library() is None:
            return None
        tensors = [t for layer in layers for t in list(layer.parameters()) + list(layer.buffers())]
        float_copies = any(getattr(m, "float_weight", None) is not None for m in layers.modules())
        return cls(cfg, layers[0].self_attn.scale, descriptors, tensors, float_copies)

    @staticmethod
    def batch_fits(x: torch.Tensor, cos: torch.Tensor, metas: list[AttentionMetadata]) -> bool:
        """A decode-only batch of 1..MAX_BATCH float32 rows on CPU, one metadata for every layer."""
        meta = metas[0]
        return (
            x.dtype == torch.float32 and x.device.type == "cpu" and 1 <= x.shape[0] <= MAX_BATCH
            and not meta.prefills and meta.num_decodes == x.shape[0] and all(m is meta for m in metas)
            and cos.dtype == torch.float32 and cos.is_contiguous()
            and meta.slot_mapping.dtype == torch.int64 and meta.decode_block_tables.dtype == torch.int64
            and meta.decode_block_tables.is_contiguous() and meta.decode_context_lens.dtype == torch.int64
        )

    def takes(self, rows: int, kv_caches: list) -> bool:
        """This many rows (MAX_ROWS at most where a weight is float32), and float32 CPU caches of this
        model's head shape (not quantized ones)."""
        return rows <= self.max_batch and self._descriptors_for(kv_caches) is not None

    def _descriptors_for(self, kv_caches: list) -> torch.Tensor | None:
        """The LayerDesc table with these caches (rebuilt only when the cache list changes)."""
        if kv_caches is not self._caches:
            self._caches, self._descriptors = kv_caches, None
            pool = kv_caches[0]._base if isinstance(kv_caches[0], torch.Tensor) else None
            if pool is not None and all(
                isinstance(c, torch.Tensor) and c._base is pool and c.dtype == torch.float32 and c.is_contiguous()
                and c.device.type == "cpu" and c.shape[-2:] == self.shape[2:] for c in kv_caches
            ):
                rows = [slots + [cache.data_ptr()] for slots, cache in zip(self.layer_slots, kv_caches)]
                self._descriptors, self._pool = torch.tensor(rows, dtype=torch.int64), pool
        return self._descriptors

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list,
                 meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after the last layer (x [B, hidden] is updated in place and returned)."""
        x = x.clone()  # updated in place: never the caller's tensor (an embedding lookup may be a view)
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        decode_step_op(
            x, self._pool, self._descriptors_for(kv_caches), cos, sin, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_context_lens, [*self.shape, num_blocks, block_size, self.window], self.eps, self.scale,
        )
        return x


def decode_step_op(x: torch.Tensor, kv_pool: torch.Tensor, descriptors: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                   sizes: list[int], eps: float, scale: float) -> None:
    """Every layer of a decode batch: x [B, hidden] (the residual stream) and the KV pool (every layer's
    cache, through the addresses in `descriptors`) are written in place. sizes: hidden, heads, KV heads,
    head dim, blocks, block size, window (0: none)."""
    _library().decode_step(x, kv_pool, descriptors, cos, sin, slots, tables, lens, sizes, eps, scale)
