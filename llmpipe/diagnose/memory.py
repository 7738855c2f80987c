"""`llmpipe memory`: will a model fit, and how many sequences at once — planned from its config alone.

Weights: the tensors runtime quantization converts (`llmpipe.quant.apply.quant_plan`: every linear
layer and the LM head) at the quantized width, scales included (as `weight_bytes_per_param` counts
them); norms, biases and an untied embedding stay in `dtype`. A GGUF loaded as it is ("auto") counts
each tensor kept quantized at the bytes it takes (`stored`: the file's own for the GGML types). KV:
`kv_bytes_per_token`, allocated in whole blocks per sequence, as the engine does; a hybrid's linear-attention
layers (Qwen3.5) instead keep a fixed state per sequence, whatever its length (`state_bytes_per_sequence`, from the
specs its layers report). The process adds RUNTIME_BYTES: what Python, PyTorch and llmpipe hold before any model,
and a step's activations (`step_bytes`: max_num_batched_tokens tokens, or fewer where the batch holds fewer).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from llmpipe.config import DTYPES, ModelConfig
from llmpipe.diagnose.costs import expert_share, read_share
from llmpipe.engine.step_size import step_bytes, step_tokens
from llmpipe.kv_cache.paged import kv_bytes_per_token
from llmpipe.loader.weight_names import expected_weight_shapes
from llmpipe.models.gpt_oss.config import GptOssFields, alternating_layer_types
from llmpipe.models.qwen3_5.config import Qwen35Fields
from llmpipe.models.qwen3_moe.config import Qwen3MoeFields
from llmpipe.models.registry import family_of
from llmpipe.quant.apply import quant_plan
from llmpipe.quant.formats import weight_bytes_per_param


def _llama(hidden: int, inter: int, layers: int, heads: int, kv_heads: int | None = None, vocab: int = 32000,
           context: int = 4096, rope_theta: float = 10000.0) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                       head_dim=hidden // heads, max_position_embeddings=context, rope_theta=rope_theta)


# Published configs (config.json of each model), for planning without the checkpoint.
def _gpt_oss(layers: int, experts: int) -> ModelConfig:
    return ModelConfig(
        architecture="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "truncate": False},
        attention_bias=True, sliding_window=128, layer_types=alternating_layer_types(layers), extra=GptOssFields(experts, 4))


NAMED_ARCHITECTURES: dict[str, ModelConfig] = {
    "llama-7b": _llama(4096, 11008, 32, 32),  # Llama 2 7B
    "llama-13b": _llama(5120, 13824, 40, 40),  # Llama 2 13B: the textbook "13B model" (40 layers, 5,120 hidden)
    "llama-70b": _llama(8192, 28672, 80, 64, kv_heads=8),
    "llama3-8b": _llama(4096, 14336, 32, 32, kv_heads=8, vocab=128256, context=8192, rope_theta=500000.0),
    "mistral-7b": _llama(4096, 14336, 32, 32, kv_heads=8, context=32768),
    # Qwen3-30B-A3B: 128 experts of 768 in every layer, 8 a token (3.3B of its 30.5B parameters)
    "qwen3-30b-a3b": ModelConfig(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
        qk_norm=True, extra=Qwen3MoeFields(128, 8, 768, True, (True,) * 48)),
    # gpt-oss-20b / -120b: 32 / 128 experts of 2,880, 4 a token (3.6B of 20.9B, 5.1B of 116.8B parameters)
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
    # transformers' Qwen3_5TextConfig defaults ("a Qwen3.5-9B style configuration"): 24 Gated DeltaNet layers with a
    # fixed state each, 8 gated full-attention layers with a K/V cache
    "qwen3.5-9b": ModelConfig(
        architecture="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, max_position_embeddings=262144, rope_theta=1e7,
        qk_norm=True, layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(32)),
        extra=Qwen35Fields(16, 32, 128, 128, 4, 0.25)),
}
HYBRID_CONTEXTS = (4096, 32768, 131072)  # the seeds' table for a hybrid: its cache against a dense model's

NOMINAL_BYTES = {"int8": 1.0, "int4": 0.5}  # per parameter, without scales
# Resident before a model loads: the interpreter, PyTorch, llmpipe and its kernels (VmRSS after importing
# them and loading the kernels, CPU build of torch 2.13: 243 MiB), the tokenizer and the engine's buffers.
RUNTIME_BYTES = 300 << 20

def process_peak(weights_resident: int, kv_bytes: int, step: int) -> int:
    """The process at its peak: the runtime, the weights, the KV (its pool, or the sequences' blocks) and a step's
    activations (step_bytes)."""
    return RUNTIME_BYTES + weights_resident + kv_bytes + step


@dataclass
class WeightBytes:
    params: int
    quantized_params: int
    resident: int  # what the engine holds: quantized weights with their scales, the rest in dtype
    uniform: int  # every parameter at the nominal width, no scales: the textbook arithmetic
    active_params: int = 0  # what one token reads: a mixture of experts' k of E experts, no untied embedding
    active_resident: int = 0  # their bytes: what batch-1 decode streams per token


def weight_bytes(cfg: ModelConfig, dtype: str, quantization: str | None = None, group_size: int = 128,
                 params: int | None = None, stored: Callable[[str], int | None] | None = None) -> WeightBytes:
    """Bytes of the model's weights. `params` rescales the architecture's mix of tensors to that
    many parameters (e.g. `--params 7e9 --arch llama-7b`); `stored` (quantization "auto"): a tensor's
    bytes where it loads quantized as the checkpoint holds it, else None."""
    dtype_bytes = DTYPES[dtype].itemsize
    shapes = expected_weight_shapes(cfg)
    linear = family_of(cfg.architecture).linear_weights(cfg)
    converted = set(quant_plan(linear, quantization, group_size, None)) if quantization in ("int8", "int4") else set()
    if not cfg.tie_word_embeddings:
        converted.discard("model.embed_tokens.weight")  # only its rows are looked up: it stays float
    as_stored = {name: stored(name) for name in linear} if quantization == "auto" and stored else {}
    share = expert_share(cfg)
    counted = quantized = 0
    resident = active = active_resident = 0.0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        counted += numel
        if as_stored.get(name) is not None:
            quantized += numel
            nbytes = as_stored[name]
        elif name in converted:
            quantized += numel
            nbytes = numel * weight_bytes_per_param(quantization, dtype_bytes, group_size, shape[1])
        else:
            nbytes = numel * dtype_bytes
        resident += nbytes
        read = read_share(cfg, name, share)
        active, active_resident = active + numel * read, active_resident + nbytes * read
    total = params or counted
    scale = total / counted
    nominal = NOMINAL_BYTES.get(quantization, dtype_bytes) if quantization else dtype_bytes
    return WeightBytes(total, round(quantized * scale), round(resident * scale), round(total * nominal),
                       round(active * scale), round(active_resident * scale))


def blocks_per_sequence(context: int, block_size: int) -> int:
    return -(-context // block_size)


def state_bytes_per_sequence(cfg: ModelConfig) -> int:
    """A sequence's fixed states (a hybrid's linear-attention layers; 0 for other models), from the cache specs the
    family's layers report (the model built on the meta device)."""
    import torch

    from llmpipe.kv_cache.layout import kv_cache_layout, kv_cache_specs

    if cfg.layer_types is None or "linear_attention" not in cfg.layer_types:
        return 0
    with torch.device("meta"):
        model = family_of(cfg.architecture).model_class(cfg)
    return kv_cache_layout(kv_cache_specs(model)).state_bytes()


@dataclass
class HybridRow:
    """One context length: a hybrid's cache per sequence, by layer kind, against a dense model's of its shape."""

    context: int
    attention_bytes: int  # the full-attention layers' K/V, whole blocks
    state_bytes: int  # the linear-attention layers' states
    dense_bytes: int  # every layer full attention, same heads

    @property
    def ratio(self) -> float:
        return (self.attention_bytes + self.state_bytes) / self.dense_bytes


def hybrid_rows(cfg: ModelConfig, dtype: str, kv_cache_dtype: str, block_size: int, states: int) -> list[HybridRow]:
    dense = dataclasses.replace(cfg, layer_types=None)
    per_token, dense_per_token = (kv_bytes_per_token(c, DTYPES[dtype], kv_cache_dtype) for c in (cfg, dense))
    slots = [blocks_per_sequence(n, block_size) * block_size for n in HYBRID_CONTEXTS]
    return [HybridRow(n, t * per_token, states, t * dense_per_token) for n, t in zip(HYBRID_CONTEXTS, slots)]


@dataclass
class MemoryPlan:
    model: str
    dtype: str
    quantization: str | None
    group_size: int
    kv_cache_dtype: str
    weights: WeightBytes
    kv_bytes_per_token: int
    context: int
    block_size: int
    kv_bytes_per_sequence: int  # whole blocks, as the engine allocates them, and the sequence's states
    batch: int
    total_bytes: int  # weights + batch sequences of KV
    process_bytes: int  # the process at its peak (process_peak): RUNTIME_BYTES + total_bytes + step_bytes
    memory: int | None = None
    max_sequences: int | None = None  # at this context, in `memory`
    notes: list[str] = field(default_factory=list)
    state_bytes_per_sequence: int = 0  # a hybrid's linear-attention states (in kv_bytes_per_sequence)
    hybrid: list[HybridRow] = field(default_factory=list)  # a hybrid's cache by layer kind against a dense model's
    step_tokens: int = 0  # the largest step: max_num_batched_tokens (engine/step_size), or the batch's tokens where fewer
    step_bytes: int = 0  # its activations (in process_bytes)

    @property
    def fits(self) -> bool | None:
        return None if self.max_sequences is None else self.max_sequences >= self.batch


def plan_memory(cfg: ModelConfig, model: str, *, dtype: str = "float32", quantization: str | None = None,
                group_size: int = 128, kv_cache_dtype: str = "auto", context: int | None = None, batch: int = 1,
                memory: int | None = None, block_size: int = 16, params: int | None = None,
                stored: Callable[[str], int | None] | None = None,
                max_num_batched_tokens: int | None = None) -> MemoryPlan:
    context = context or cfg.max_position_embeddings
    tokens = min(step_tokens(max_num_batched_tokens, cfg), context * batch)
    step = step_bytes(cfg, tokens)
    weights = weight_bytes(cfg, dtype, quantization, group_size, params, stored)
    per_token = kv_bytes_per_token(cfg, DTYPES[dtype], kv_cache_dtype)
    blocks = blocks_per_sequence(context, block_size)
    states = state_bytes_per_sequence(cfg)
    per_sequence = blocks * block_size * per_token + states
    plan = MemoryPlan(model, dtype, quantization, group_size, kv_cache_dtype, weights, per_token, context,
                      block_size, per_sequence, batch, weights.resident + batch * per_sequence,
                      process_peak(weights.resident, batch * per_sequence, step), memory,
                      state_bytes_per_sequence=states, step_tokens=tokens, step_bytes=step)
    if states:
        plan.hybrid = hybrid_rows(cfg, dtype, kv_cache_dtype, block_size, states)
    if memory is not None:
        plan.max_sequences = max(memory - weights.resident, 0) // per_sequence
    plan.notes = rounding_notes(plan)
    return plan


def rounding_notes(plan: MemoryPlan) -> list[str]:
    """Where round figures (like the textbook "about 1 MiB per token") part from the exact ones."""
    w, notes = plan.weights, []
    if plan.quantization == "auto" and w.quantized_params:
        notes.append(f"{w.quantized_params:,} parameters stay as the checkpoint stores them "
                     f"({w.resident / 1e9:.2f} GB of weights in all)")
    elif w.uniform != w.resident:
        width = NOMINAL_BYTES.get(plan.quantization, DTYPES[plan.dtype].itemsize)
        why = []
        if w.quantized_params:
            scales = w.resident - w.uniform - (w.params - w.quantized_params) * (DTYPES[plan.dtype].itemsize - width)
            why.append(f"{scales / 1e9:.2f} GB of scales ({plan.quantization}"
                       + (f", groups of {plan.group_size})" if plan.quantization == "int4" else ", one per row)"))
        if w.quantized_params < w.params:
            why.append(f"{w.params - w.quantized_params:,} parameters left in {plan.dtype} (norms, untied embedding)")
        notes.append(f"{w.params:,} parameters × {width:g} B = {w.uniform / 1e9:.2f} GB is the every-parameter-at-"
                     f"nominal-width figure (the textbook arithmetic); resident {w.resident / 1e9:.2f} GB adds "
                     + " and ".join(why))
    mib = plan.kv_bytes_per_token / 2**20
    rounded = round(mib)
    if rounded >= 1 and abs(rounded - mib) / mib > 0.05:
        notes.append(f"KV per token is {mib:.2f} MiB; rounded to {rounded} MiB it would give "
                     f"{rounded * plan.context / 1024:g} GiB at {plan.context:,} tokens instead of "
                     f"{plan.kv_bytes_per_token * plan.context / 2**30:.3f} GiB")
    if plan.context % plan.block_size:
        slots = blocks_per_sequence(plan.context, plan.block_size) * plan.block_size
        notes.append(f"a sequence takes whole blocks of {plan.block_size} tokens: {plan.context:,} tokens "
                     f"occupy {slots:,} slots")
    return notes
