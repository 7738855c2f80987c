"""A Llama-family decode step in one C call (kernels/csrc/decode_step.c), the torch op `llmpipe::decode_step`
(kernels/csrc/ops.cpp): Llama, Mistral, Qwen 2/3, Gemma 3, Qwen3-MoE and gpt-oss bodies.

At batch 1 a decode step is ~7 small matrix-vector products per layer plus norms, RoPE and
attention: run as one PyTorch or kernel op call each, with Python between them, the calls cost more
than streaming the weights (profiled: ~3,200 ATen ops per token). The kernel runs every
layer of a decode-only batch (up to MAX_BATCH rows) in one OpenMP region, and the body's final norm;
the embedding and the LM head stay in PyTorch (one call each). (Each op between the kernels costs several
times its warm cost here: a step streams every weight through the caches, so the Python and PyTorch
code after it runs cold — torch.rms_norm on one 640-wide row took ~200 us after the LM head, ~17 warm.)

A decoder layer says which of its norms sit where (`decode_step_norms`: Llama's two, Gemma's four) and
which RoPE table it takes (`decode_step_rope`);
q/k norms, the activation, each layer's RoPE table, window and cache group come from the layer and
the step's metadata. Each linear keeps its own numerics: float activations into the exact low-bit row
kernels (bit for bit the per-op kernels' results), or 8- or 16-bit activation blocks where the layer has
`activation_bits` set. The layer-by-layer path stays for everything else — prefill, mixed batches, int4 caches,
other families — and is what this step is tested against.
"""

from __future__ import annotations

import struct

import torch
import torch.nn.functional as F
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.kernels.abi import ABI
from llmpipe.kernels import ops
from llmpipe.layers.attention import AttentionMetadata
from llmpipe.layers.attention_kernel import cache_tensors
from llmpipe.layers.linear import Linear
from llmpipe.layers.norm import RMSNorm
from llmpipe.quant.linear import (FLOAT_BATCH_MIN_ROWS, KERNEL_MAX_BATCH, PANEL_MIN_ROWS, GGMLLinear, Int4Linear,
                                  Int8Linear, Q5_0Linear)

MAX_ROWS = ABI["MAX_ROWS"]  # the row kernels' widest run (larger batches go MAX_ROWS rows at a time)
# Batches up to this many rows take the step: quantized weights as far as their per-op kernels go
# (above it, dequantizing once for a GEMM wins); float32 weights only up to MAX_ROWS, beyond which
# MKL's GEMM, reading each weight once for every row, beats re-reading them per run of MAX_ROWS.
MAX_BATCH = KERNEL_MAX_BATCH
# With activation quantization on every linear (panels: each weight read once a step for the whole
# batch, as a GEMM reads it), the step takes decode batches up to this.
PANEL_MAX_BATCH = 256
# The descriptors' layout (csrc/abi.h, which decode_step.c checks its structs against).
F32, INT4, INT8, Q5_0, GGML, EXPERTS = (ABI[f"KIND_{kind}"] for kind in ("F32", "INT4", "INT8", "Q5_0", "GGML", "EXPERTS"))
LINEAR_SLOTS = ABI["LINEAR_WORDS"]  # LinearDesc: kind, bits, weight, scale, offset, bias, N, K, group, panels, lora
ACTS = {"silu": ABI["ACT_SILU"], "swish": ABI["ACT_SILU"], "gelu_pytorch_tanh": ABI["ACT_GELU_TANH"],
        "gelu_new": ABI["ACT_GELU_TANH"]}
TABLE_WORD = ABI["LAYER_TABLE_WORD"]  # LayerDesc.table: the layer's block-table set, set per step
CLAMPED_SWIGLU = ABI["ACT_CLAMPED_SWIGLU"]  # gpt-oss's experts' (their `limit` and `alpha`)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _lora(module: nn.Module) -> int:
    """The address of a linear's LoraDesc (lora/slots.py), 0 where no adapter slots are attached to it."""
    return _ptr(getattr(module, "lora_desc", None))


def linear_slots(module: nn.Module) -> list[int] | None:
    """A linear's LinearDesc, or None where the kernel does not take its kind of weight."""
    bias = getattr(module, "bias", None)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    if type(module) is Linear:
        w = module.weight
        if w.dtype != torch.float32 or not w.is_contiguous() or w.shape[1] % 16:
            return None
        return [F32, 0, w.data_ptr(), 0, 0, _ptr(bias), w.shape[0], w.shape[1], w.shape[1], 0, _lora(module)]
    if isinstance(module, GGMLLinear):  # integer-dot activations only; the segments' table where `offset` goes
        if not module.activation_bits:
            return None
        return [GGML, module.activation_bits, 0, 0, module.segment_table.data_ptr(), _ptr(bias),
                module.out_features, module.in_features, len(module.segments), 0, _lora(module)]
    if not isinstance(module, (Int4Linear, Int8Linear, Q5_0Linear)) or module.padded_in != module.in_features:
        return None
    bits = module.activation_bits or 0
    panels = module.batch_panels() if module.takes_panels(PANEL_MIN_ROWS) else None  # batches: each weight read once
    if isinstance(module, Int4Linear):
        if module.in_perm is not None:
            return None
        return [INT4, bits, module.codes.data_ptr(), module.scale.data_ptr(), module.offset.data_ptr(), _ptr(bias),
                module.out_features, module.in_features, module.group_size, _ptr(panels), _lora(module)]
    if isinstance(module, Q5_0Linear):
        return [Q5_0, bits, module.blocks.data_ptr(), 0, 0, _ptr(bias), module.out_features, module.in_features,
                module.group_size, _ptr(panels), _lora(module)]
    return [INT8, bits, module.q.data_ptr(), module.scale.data_ptr(), 0, _ptr(bias), module.out_features,
            module.in_features, module.group_size, _ptr(panels), _lora(module)]


def norm_multiplier(norm: nn.Module | None, eps: float) -> torch.Tensor | None:
    """What the kernel multiplies a normed row by (Gemma's 1 + weight), or None where it cannot run the norm."""
    if type(norm) is not RMSNorm or norm.eps != eps or norm.weight.dtype != torch.float32:
        return None
    weight = norm.unit_weight() if norm.unit_offset else norm.weight
    return weight if weight.is_contiguous() else None


def experts_slots(mlp: nn.Module) -> tuple[list[int], torch.Tensor] | None:
    """A mixture of experts' MLP (layers/moe.py's router, as `gate` or `router`, and `experts`) as the LinearDesc
    words its gate_up and down slots both hold, and the ExpertsDesc they point at; None where the kernel does not
    run it."""
    router, experts = getattr(mlp, "router", None) or mlp.gate, mlp.experts
    if hasattr(mlp, "shared_expert"):  # Qwen2-MoE's gated shared expert: the layered path
        return None
    (weight, bias), (count, hidden) = (router.weight, router.bias), router.weight.shape
    if any(t is not None and (t.dtype != torch.float32 or not t.is_contiguous()) for t in (weight, bias)) or hidden % 16:
        return None
    router_slots = [F32, 0, weight.data_ptr(), 0, 0, _ptr(bias), count, hidden, hidden, 0, 0]
    linears = [linear_slots(e.gate_up_proj) for e in experts] + [linear_slots(e.down_proj) for e in experts]
    if any(slots is None for slots in linears) or len({slots[1] for slots in linears}) != 1:
        return None
    clamp = [float_bits(getattr(experts[0], name, 0.0)) for name in ("alpha", "limit")]  # gpt-oss's SwiGLU
    desc = torch.tensor([count, router.top_k, int(router.renormalize), *clamp, *router_slots, *sum(linears, [])],
                        dtype=torch.int64)
    inner = experts[0].down_proj.in_features
    return [EXPERTS, linears[0][1], desc.data_ptr(), 0, 0, 0, 2 * router.top_k * inner, hidden, 0, 0, 0], desc


def float_bits(value: float) -> int:
    """A float64's bits as the int64 word a descriptor holds it in."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def layer_slots(layer: nn.Module, cfg: ModelConfig) -> tuple[list[int], list[torch.Tensor]] | None:
    """A layer's LayerDesc words but its cache (table set 0) and the tensors they point into, or None
    where the kernel does not run it."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = [*layer.decode_step_norms(), attn.q_norm, attn.k_norm]
    required = 2 if norms[2] is None else 4  # input and pre-MLP; with output norms, those too
    multipliers = [norm_multiplier(n, cfg.rms_norm_eps) if n is not None else None for n in norms]
    if any(m is None for m in multipliers[:required]) or any(
            m is None for n, m in zip(norms[required:], multipliers[required:]) if n is not None):
        return None
    extra = [m for m in multipliers if m is not None]
    act = ACTS[cfg.hidden_act]
    if hasattr(mlp, "experts"):  # a mixture of experts: no norm on its output
        experts = experts_slots(mlp) if norms[3] is None else None
        if experts is None:
            return None
        mlp_slots = [experts[0], experts[0]]
        extra.append(experts[1])
        act = CLAMPED_SWIGLU if hasattr(mlp.experts[0], "limit") else act
    else:
        mlp_slots = [linear_slots(mlp.gate_up_proj), linear_slots(mlp.down_proj)]
    linears = [linear_slots(attn.qkv_proj), linear_slots(attn.o_proj), *mlp_slots]
    if any(slots is None for slots in linears):
        return None
    input_norm, mlp_norm, attn_out, mlp_out, q_norm, k_norm = (_ptr(m) for m in multipliers)
    rope = layer.decode_step_rope()
    sinks = getattr(attn, "sinks", None)
    if sinks is not None:
        if sinks.dtype != torch.float32 or not sinks.is_contiguous():
            return None
        extra.append(sinks)
    words = [input_norm, mlp_norm, *sum(linears, []), q_norm, k_norm, attn_out, mlp_out, act, rope, attn.window or 0,
             _ptr(sinks), 0]
    return words, extra


class LlamaDecodeStep:
    """Every layer of a Llama-family body for one decode-only batch. `build` returns None for a body the
    kernel does not run (other norms or activations, unequal attention scales, bfloat16, sharded or
    act-order weights, no compiler); `batch_fits` and `takes` say per step whether the batch and cache do."""

    def __init__(self, cfg: ModelConfig, scale: float, layer_slots: list[list[int]], tensors: list[torch.Tensor],
                 float_copies: bool = False, final_norm: torch.Tensor | None = None):
        self.tensors = tensors  # every tensor whose address layer_slots holds, kept alive with them
        self.final_norm = final_norm  # the body's last norm's multiplier (None: the body norms the output itself)
        linears = [slots[2 + LINEAR_SLOTS * i:2 + LINEAR_SLOTS * (i + 1)] for slots in layer_slots for i in range(4)]
        has_float, all_dot = any(w[0] == F32 for w in linears), all(w[1] for w in linears)  # kind, bits
        self.max_batch = MAX_ROWS if has_float else PANEL_MAX_BATCH if all_dot else MAX_BATCH
        if float_copies:  # from FLOAT_BATCH_MIN_ROWS rows the layers' float copies are faster
            self.max_batch = min(self.max_batch, FLOAT_BATCH_MIN_ROWS - 1)
        self.eps, self.scale = cfg.rms_norm_eps, scale
        self.shape = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.layer_slots = layer_slots  # LayerDesc per layer, without its cache pointer
        self._caches: list | None = None
        self._table_sets: tuple[int, ...] = ()  # what the descriptors' table column holds
        self._descriptors: torch.Tensor | None = None
        self._pool: torch.Tensor | None = None  # the tensor every layer's cache (int8: its codes) is a view of
        self._scale_pool: torch.Tensor | None = None  # int8 caches: the tensor their scales are views of

    @classmethod
    def build(cls, layers: nn.ModuleList, cfg: ModelConfig, final_norm: nn.Module | None = None) -> LlamaDecodeStep | None:
        """layers: decoder layers with `decode_step_norms` (the weights are read now: build after loading
        them); final_norm: the body's norm after them, run in the step where the kernel runs its kind."""
        if cfg.hidden_act not in ACTS or cfg.hidden_size % 8 or cfg.head_dim % 8:
            return None
        built = [layer_slots(layer, cfg) for layer in layers]
        scales = {layer.self_attn.scale for layer in layers}
        if any(b is None for b in built) or len(scales) != 1 or not ops.available():
            return None
        tensors = [t for layer in layers for t in list(layer.parameters()) + list(layer.buffers())]
        tensors += [t for _, extra in built for t in extra]
        float_copies = any(getattr(m, "float_weight", None) is not None for m in layers.modules())
        final = norm_multiplier(final_norm, cfg.rms_norm_eps) if final_norm is not None else None
        return cls(cfg, scales.pop(), [words for words, _ in built], tensors, float_copies, final)

    @staticmethod
    def batch_fits(x: torch.Tensor, cos: torch.Tensor, metas: list[AttentionMetadata]) -> bool:
        """A decode-only batch of float32 rows on CPU in every layer's metadata (each cache group's
        metadata checked once: its layers share it)."""
        rows = x.shape[0]
        return (
            x.dtype == torch.float32 and x.device.type == "cpu" and rows >= 1
            and cos.dtype == torch.float32 and cos.is_contiguous()
            and all(not m.prefills and m.num_decodes == rows and m.slot_mapping.dtype == torch.int64
                    and m.decode_block_tables.dtype == torch.int64 and m.decode_block_tables.is_contiguous()
                    and m.decode_context_lens.dtype == torch.int64 for m in {id(m): m for m in metas}.values())
        )

    def takes(self, rows: int, kv_caches: list) -> bool:
        """This many rows (MAX_ROWS at most where a weight is float32, PANEL_MAX_BATCH where every
        weight meets quantized activations, else MAX_BATCH), and CPU caches of this model's head shape,
        float32 or int8 (not int4's rotated groups)."""
        return rows <= self.max_batch and self._descriptors_for(kv_caches) is not None

    def _descriptors_for(self, kv_caches: list) -> torch.Tensor | None:
        """The LayerDesc table with these caches (rebuilt only when the cache list changes)."""
        if kv_caches is not self._caches:
            self._caches, self._descriptors, self._table_sets = kv_caches, None, (0,) * len(kv_caches)
            views = [_cache_views(c, self.shape[2:]) for c in kv_caches]
            pools = {None if v is None else tuple(t if t is None else t._base for t in v) for v in views}
            if len(pools) == 1 and None not in pools:
                rows = [slots + [codes.data_ptr(), _ptr(scales)]
                        for slots, (codes, scales) in zip(self.layer_slots, views)]
                self._descriptors = torch.tensor(rows, dtype=torch.int64)
                self._pool, self._scale_pool = pools.pop()
        return self._descriptors

    def _set_tables(self, descriptors: torch.Tensor, table_sets: tuple[int, ...]) -> None:
        """Each layer's block-table set (its cache group's position among this step's metadata)."""
        if table_sets != self._table_sets:
            descriptors[:, TABLE_WORD] = torch.tensor(table_sets)
            self._table_sets = table_sets

    def __call__(self, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]], kv_caches: list,
                 metas: list[AttentionMetadata]) -> torch.Tensor:
        """The residual stream after the last layer, normed by `final_norm` where the step has it (a
        copy of x, updated in place and returned). ropes: the (cos, sin) tables layers name (Gemma 3:
        global, local); metas: each layer's."""
        x = x.clone()  # updated in place: never the caller's tensor (an embedding lookup may be a view)
        rows, head_dim = x.shape[0], self.shape[3]
        by_id = {id(m): m for m in metas}  # the step's cache groups, in order of first use
        index = {key: i for i, key in enumerate(by_id)}
        table_sets, groups = tuple(index[id(m)] for m in metas), list(by_id.values())
        cos, sin = (tables[0].reshape(1, rows, head_dim) if len(tables) == 1  # a view: no copy per step
                    else torch.stack([t.reshape(rows, head_dim) for t in tables]) for tables in zip(*ropes))
        if len(groups) == 1:
            m = groups[0]
            slots, tables, lens = m.slot_mapping[None], m.decode_block_tables[None], m.decode_context_lens[None]
        else:
            width = max(m.decode_block_tables.shape[1] for m in groups)
            slots = torch.stack([m.slot_mapping for m in groups])
            tables = torch.stack([F.pad(m.decode_block_tables, (0, width - m.decode_block_tables.shape[1])) for m in groups])
            lens = torch.stack([m.decode_context_lens for m in groups])
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        descriptors = self._descriptors_for(kv_caches)
        self._set_tables(descriptors, table_sets)
        decode_step_op(x, self._pool, self._scale_pool, descriptors, cos, sin, slots, tables, lens,
                       [*self.shape, num_blocks, block_size], self.eps, self.scale, self.final_norm)
        return x


def _cache_views(cache, head_shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A layer's cache as the kernels read it (attention_kernel.cache_tensors), each tensor a view of the
    whole cache's, of this model's head shape — or None where the step does not take it."""
    tensors = cache_tensors(cache)
    if tensors is None or tensors[0].shape[-2:] != head_shape or any(t._base is None for t in tensors if t is not None):
        return None
    return tensors


def decode_step_op(x: torch.Tensor, kv_pool: torch.Tensor, kv_scales: torch.Tensor | None, descriptors: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                   sizes: list[int], eps: float, scale: float, final_norm: torch.Tensor | None = None) -> None:
    """Every layer of a decode batch: x [B, hidden] (the residual stream; normed by final_norm at the
    end where given) and the KV pool (every layer's cache, through the addresses in `descriptors`; int8
    caches: their codes, and kv_scales their scales) are written in place. cos / sin [R, B, head dim];
    slots [S, B], tables [S, B, W], lens [S, B]. sizes: hidden, heads, KV heads, head dim, blocks, block size."""
    ops.decode_step(x, kv_pool, kv_scales, descriptors, cos, sin, slots, tables, lens, sizes, eps, scale, final_norm)


class FusedDecodeBody:
    """A model body (nn.Module with `layers`, `norm`, `config`) whose decode-only batches may take the fused step.
    A subclass whose layers the kernel does not compute (Phi-3's partial rotary) sets fuses_decode False."""

    fuses_decode = True
    fused_decode = True  # per instance, False: decode layer by layer too (the path the fused step is tested against)
    # Set by lora.LoRAManager while a step has adapter rows whose factors the fused step cannot read: the layer path.
    lora_active = False
    _decode_step: LlamaDecodeStep | None | bool = False  # False: not built yet (built at the first decode)

    def fused_layers(self, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]], kv_caches: list,
                     metas: list[AttentionMetadata]) -> torch.Tensor | None:
        """The body's output (every layer, then its final norm `self.norm`) in one call; None where the
        step does not apply."""
        if self.lora_active or not LlamaDecodeStep.batch_fits(x, ropes[0][0], metas):
            return None
        step = self.decode_step()
        if step is None or not step.takes(x.shape[0], kv_caches):
            return None
        out = step(x, ropes, kv_caches, metas)
        return out if step.final_norm is not None else self.norm(out)

    def reset_decode_step(self) -> None:
        """Rebuild the fused step at the next decode (its linears' descriptors changed: LoRA slots attached)."""
        self._decode_step = False

    def decode_step(self) -> LlamaDecodeStep | None:
        """The whole-stack decode kernel for this body, where it applies (built at the first decode step)."""
        if not (self.fused_decode and self.fuses_decode):
            return None
        if self._decode_step is False:
            self._decode_step = LlamaDecodeStep.build(self.layers, self.config, self.norm)
        return self._decode_step
