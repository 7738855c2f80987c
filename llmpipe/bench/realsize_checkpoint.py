"""Random-weight Hugging Face checkpoints at the shapes of real models, for `llmpipe bench realsize`.

A benchmark of memory-bound decode needs the real byte counts and matrix shapes, not the real
weights: the checkpoints here have the published configs of Llama-3.2-1B / 3B, Llama-3.1-8B,
Qwen2.5-7B, Qwen3-30B-A3B (12 of its 48 layers, each at its real shapes: 128 experts of which a token
reads 8, so a token costs what it costs in the whole model's layers, times 12 / 48; the whole model
would not fit in this machine's memory beside the benchmark) and gpt-oss-20b (whole: 24 layers of 32
experts, its experts in MXFP4 as OpenAI ships them), normal(0, 0.02) weights in bfloat16 (gpt-oss's
experts: random E2M1 codes under exponents of about that spread) and a synthetic byte-level BPE
tokenizer of the right vocabulary size. They are written a shard of a
few tensors at a time (an 8B model never sits in memory whole) so that llama.cpp's own converter can
turn them into GGUFs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch

# Llama 3.1 / 3.2's long-context RoPE rescaling ("llama3"); the factor is 8 for 3.1 and 32 for 3.2.
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SHARD_BYTES = 1 << 30  # about one decoder layer of an 8B model per shard


@dataclass(frozen=True)
class Shape:
    """One model's architecture as its config.json states it."""

    name: str
    model_type: str  # "llama", "qwen2", "qwen3_moe" or "gpt_oss"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int  # rows of the embedding (Qwen2.5 pads it past the tokenizer)
    regular_tokens: int  # BPE tokens; special tokens follow, then padding up to `vocab`
    special_tokens: int
    named_specials: tuple[str, ...]
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    rope_scaling: dict[str, Any] | None = field(default=None)
    explicit_head_dim: int | None = None  # where it is not hidden / heads (Qwen3)
    experts: int = 0  # a mixture of experts: how many, how many a token reads, and each one's width
    experts_per_token: int = 0
    expert_intermediate: int = 0
    # A hybrid (Qwen3.5): its Gated DeltaNet layers' key heads, value heads, key and value head dims; every
    # `full_attention_interval`-th layer is gated full attention with partial RoPE
    linear: tuple[int, int, int, int] = ()
    full_attention_interval: int = 4

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    @property
    def hybrid(self) -> bool:
        return bool(self.linear)

    def linear_layer(self, i: int) -> bool:
        return self.hybrid and (i + 1) % self.full_attention_interval != 0

    @property
    def converter_args(self) -> tuple[str, ...]:
        """Beyond the paths: Qwen3.5's converter expects multi-token-prediction layers unless told there are none."""
        return ("--no-mtp",) if self.hybrid else ()

    @property
    def qkv_bias(self) -> bool:
        return self.model_type in ("qwen2", "gpt_oss")

    @property
    def bpe_pre(self) -> str:
        """The `tokenizer.ggml.pre` name of the real model's pre-tokenizer (llama.cpp's converter
        recognises a tokenizer by hashing real text, which a synthetic vocabulary cannot match)."""
        return {"llama": "llama-bpe", "gpt_oss": "gpt-4o"}.get(self.model_type, "qwen2")

    def specials(self) -> list[str]:
        """The special tokens' strings in id order: the real model's first ones, then placeholders."""
        filler = "<|reserved_special_token_{}|>" if self.model_type == "llama" else "<|extra_special_{}|>"
        named = list(self.named_specials)
        return named + [filler.format(i + 3) for i in range(self.special_tokens - len(named))]

    def config(self) -> dict[str, Any]:
        """config.json as the published checkpoint has it (legacy rope keys: what both the converter
        and transformers read)."""
        bos = self.regular_tokens
        eos = {"llama": bos + 1, "gpt_oss": bos + 4}.get(self.model_type, bos)  # gpt-oss: <|return|>
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type, "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings, "hidden_act": "silu", "initializer_range": 0.02,
            "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16", "use_cache": True,
            "attention_dropout": 0.0,
        }
        if self.model_type == "llama":
            config |= {"head_dim": self.head_dim, "attention_bias": False, "mlp_bias": False,
                       "pretraining_tp": 1, "rope_scaling": self.rope_scaling}
        elif self.model_type == "qwen3_moe":
            config |= {"head_dim": self.head_dim, "attention_bias": False, "use_sliding_window": False,
                       "sliding_window": None, "max_window_layers": self.layers, "rope_scaling": None,
                       "num_experts": self.experts, "num_experts_per_tok": self.experts_per_token,
                       "moe_intermediate_size": self.expert_intermediate, "norm_topk_prob": True,
                       "decoder_sparse_step": 1, "mlp_only_layers": []}
        elif self.model_type == "gpt_oss":  # openai/gpt-oss-20b's config.json
            config |= {"head_dim": self.head_dim, "attention_bias": True, "sliding_window": 128,
                       "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.layers)],
                       "rope_scaling": self.rope_scaling, "num_local_experts": self.experts,
                       "num_experts_per_tok": self.experts_per_token, "experts_per_token": self.experts_per_token,
                       "swiglu_limit": 7.0, "pad_token_id": bos + 1,
                       "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                           "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
        elif self.hybrid:  # Qwen3_5TextConfig's names
            k_heads, v_heads, k_dim, v_dim = self.linear
            config |= {"head_dim": self.head_dim, "attention_bias": False,
                       "layer_types": ["linear_attention" if self.linear_layer(i) else "full_attention"
                                       for i in range(self.layers)],
                       "full_attention_interval": self.full_attention_interval, "linear_conv_kernel_dim": 4,
                       "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads,
                       "linear_key_head_dim": k_dim, "linear_value_head_dim": v_dim,
                       "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                           "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                           "mrope_interleaved": True}}
        else:
            config |= {"use_sliding_window": False, "sliding_window": self.max_position,
                       "max_window_layers": self.layers, "rope_scaling": None}
        return config

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every tensor's name and shape, in the order the checkpoint stores them."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        yield "model.embed_tokens.weight", (self.vocab, self.hidden)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (self.hidden,)
            if self.hybrid:
                yield from self._hybrid_mixer(p, i)
                yield p + "post_attention_layernorm.weight", (self.hidden,)
                yield from self._mlp(f"{p}mlp.", self.intermediate)
                continue
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                yield p + f"self_attn.{proj}.weight", (rows, self.hidden)
                if self.qkv_bias:
                    yield p + f"self_attn.{proj}.bias", (rows,)
            yield p + "self_attn.o_proj.weight", (self.hidden, q)
            if self.model_type == "gpt_oss":
                yield p + "self_attn.o_proj.bias", (self.hidden,)
                yield p + "self_attn.sinks", (self.heads,)
            if self.model_type == "qwen3_moe":
                yield p + "self_attn.q_norm.weight", (self.head_dim,)
                yield p + "self_attn.k_norm.weight", (self.head_dim,)
            yield p + "post_attention_layernorm.weight", (self.hidden,)
            if self.model_type == "gpt_oss":
                yield from self._gpt_oss_experts(p + "mlp.")
            elif self.experts:
                yield p + "mlp.gate.weight", (self.experts, self.hidden)
                for e in range(self.experts):
                    yield from self._mlp(f"{p}mlp.experts.{e}.", self.expert_intermediate)
            else:
                yield from self._mlp(f"{p}mlp.", self.intermediate)
        yield "model.norm.weight", (self.hidden,)
        if not self.tie_embeddings:
            yield "lm_head.weight", (self.vocab, self.hidden)

    def _gpt_oss_experts(self, prefix: str) -> Iterator[tuple[str, tuple[int, ...]]]:
        """The router and the experts as OpenAI ships them: MXFP4 blocks and scales (uint8) of each 3-D
        weight [experts, out, in / 32, 16] / [experts, out, in / 32], float biases."""
        inner, hidden, experts = self.expert_intermediate, self.hidden, self.experts
        yield prefix + "router.weight", (experts, hidden)
        yield prefix + "router.bias", (experts,)
        for proj, rows, columns in (("gate_up_proj", 2 * inner, hidden), ("down_proj", hidden, inner)):
            yield prefix + f"experts.{proj}_blocks", (experts, rows, columns // 32, 16)
            yield prefix + f"experts.{proj}_scales", (experts, rows, columns // 32)
            yield prefix + f"experts.{proj}_bias", (experts, rows)

    def _hybrid_mixer(self, p: str, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        """A Qwen3.5 layer's Gated DeltaNet, or its gated attention (q_proj: per head [q | gate])."""
        if not self.linear_layer(i):
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            for proj, rows in (("q_proj", 2 * q), ("k_proj", kv), ("v_proj", kv)):
                yield p + f"self_attn.{proj}.weight", (rows, self.hidden)
            yield p + "self_attn.o_proj.weight", (self.hidden, q)
            yield p + "self_attn.q_norm.weight", (self.head_dim,)
            yield p + "self_attn.k_norm.weight", (self.head_dim,)
            return
        k_heads, v_heads, k_dim, v_dim = self.linear
        channels, values = 2 * k_heads * k_dim + v_heads * v_dim, v_heads * v_dim
        a = p + "linear_attn."
        yield a + "in_proj_qkv.weight", (channels, self.hidden)
        yield a + "in_proj_z.weight", (values, self.hidden)
        yield a + "in_proj_b.weight", (v_heads, self.hidden)
        yield a + "in_proj_a.weight", (v_heads, self.hidden)
        yield a + "conv1d.weight", (channels, 1, 4)
        yield a + "dt_bias", (v_heads,)
        yield a + "A_log", (v_heads,)
        yield a + "norm.weight", (v_dim,)
        yield a + "out_proj.weight", (self.hidden, values)

    def _mlp(self, prefix: str, inner: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        yield prefix + "gate_proj.weight", (inner, self.hidden)
        yield prefix + "up_proj.weight", (inner, self.hidden)
        yield prefix + "down_proj.weight", (self.hidden, inner)

    def takes(self, qtype: str) -> bool:
        """Whether llama-quantize makes `qtype` of this model: gpt-oss's experts ship as MXFP4 (MXFP4_MOE keeps
        them, the rest Q8_0), which the other types would have to requantize; the dense models are not MoE."""
        return (qtype == "MXFP4_MOE") == (self.model_type == "gpt_oss")

    def parameters(self) -> int:
        """Weights, an MXFP4 block's 16 bytes counted as its 32 weights (its scales as none)."""
        return sum(_numel(shape) * (2 if name.endswith("_blocks") else 0 if name.endswith("_scales") else 1)
                   for name, shape in self.tensors())


GPT_OSS_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>",
                    "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
                    "<|reserved_200009|>", "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>")


def _llama(name: str, hidden: int, intermediate: int, layers: int, heads: int, factor: float, tie: bool) -> Shape:
    return Shape(name, "llama", hidden, intermediate, layers, heads, 8, 128256, 128000, 256, LLAMA3_SPECIALS,
                 500000.0, 1e-5, 131072, tie, LLAMA3_ROPE | {"factor": factor})


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}
QWEN3_SPECIALS = (*QWEN2_SPECIALS, "<|object_ref_start|>")
SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": _llama("llama-3.2-1b", 2048, 8192, 16, 32, 32.0, True),
    "llama-3.2-3b": _llama("llama-3.2-3b", 3072, 8192, 28, 24, 32.0, True),
    "llama-3.1-8b": _llama("llama-3.1-8b", 4096, 14336, 32, 32, 8.0, False),
    "qwen2.5-7b": Shape("qwen2.5-7b", "qwen2", 3584, 18944, 28, 28, 4, 152064, 151643, 22, QWEN2_SPECIALS,
                        1000000.0, 1e-6, 131072, False),
    # Qwen3-30B-A3B's config but for 12 of its 48 layers (the file's name says so)
    "qwen3-30b-a3b-12l": Shape("qwen3-30b-a3b-12l", "qwen3_moe", 2048, 6144, 12, 32, 4, 151936, 151643, 26,
                               QWEN3_SPECIALS, 1000000.0, 1e-6, 40960, False, explicit_head_dim=128, experts=128,
                               experts_per_token=8, expert_intermediate=768),
    "gpt-oss-20b": Shape("gpt-oss-20b", "gpt_oss", 2880, 2880, 24, 64, 8, 201088, 199998, 1090, GPT_OSS_SPECIALS,
                         150000.0, 1e-5, 131072, False, explicit_head_dim=64, experts=32, experts_per_token=4,
                         expert_intermediate=2880,
                         rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "truncate": False, "original_max_position_embeddings": 4096}),
    # transformers' Qwen3_5TextConfig defaults, "a Qwen3.5-9B style configuration": 24 Gated DeltaNet layers and 8
    # gated full-attention layers (every 4th)
    "qwen3.5-9b": Shape("qwen3.5-9b", "qwen3_5_text", 4096, 12288, 32, 16, 4, 248320, 248044, 33, QWEN3_SPECIALS,
                        10000000.0, 1e-6, 262144, False, explicit_head_dim=256, linear=(16, 32, 128, 128)),
}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def shard_groups(tensors: list[tuple[str, tuple[int, ...]]], shard_bytes: int = SHARD_BYTES,
                 itemsize: int = 2) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors packed into shards of at most `shard_bytes` (a bigger tensor alone):
    the writer's memory is one shard."""
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = _numel(shape) * itemsize
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    return groups


def random_tensor(name: str, shape: tuple[int, ...], generator: "torch.Generator", std: float) -> "torch.Tensor":
    """Norm weights at one (as trained models keep them near), MXFP4 blocks random E2M1 codes under exponents
    that give them about `std` (the codes' RMS is 2.9), everything else normal(0, std)."""
    import math

    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith("_blocks"):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    if name.endswith("_scales"):
        exponent = 127 + round(math.log2(std / 2.9))
        return torch.randint(exponent - 1, exponent + 2, shape, dtype=torch.uint8, generator=generator)
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, std, generator=generator)


def write_checkpoint(shape: Shape, out_dir: Path, seed: int = 0, std: float = 0.02,
                     shard_bytes: int = SHARD_BYTES, progress: bool = True) -> Path:
    """config.json, safetensors shards, model.safetensors.index.json (written last: a directory with
    it is complete) and a tokenizer; a no-op when the index is already there."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    index_path = out_dir / "model.safetensors.index.json"
    if index_path.exists():
        return out_dir
    (out_dir / "config.json").write_text(json.dumps(shape.config(), indent=2))
    write_tokenizer(shape, out_dir, seed)
    generator = torch.Generator().manual_seed(seed)
    groups = shard_groups(list(shape.tensors()), shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(tqdm(groups, desc=f"{shape.name}: safetensors", unit="shard", disable=not progress)):
        filename = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: random_tensor(name, dims, generator, std) for name, dims in group}
        save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map |= dict.fromkeys(tensors, filename)
        del tensors
    index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out_dir


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (what byte-level BPE vocabularies hold)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def synthetic_bpe(size: int, seed: int = 0, max_len: int = 16) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of exactly `size` tokens: the 256 bytes, then merges of random
    pairs of earlier tokens (each merge makes the next token, so the ranks are consistent)."""
    rng = random.Random(seed)
    tokens = byte_alphabet()
    seen = set(tokens)
    merges: list[tuple[str, str]] = []
    while len(tokens) < size:
        a = tokens[rng.randrange(len(tokens))]
        b = tokens[rng.randrange(min(len(tokens), 4096))]
        if len(a) + len(b) > max_len or a + b in seen:
            continue
        tokens.append(a + b)
        seen.add(a + b)
        merges.append((a, b))
    return {t: i for i, t in enumerate(tokens)}, merges


def write_tokenizer(shape: Shape, out_dir: Path, seed: int = 0) -> None:
    """tokenizer.json (byte-level BPE, the model's special tokens after its regular ones) and a
    tokenizer_config.json that transformers' AutoTokenizer (the converter's reader) accepts."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = synthetic_bpe(shape.regular_tokens, seed)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = shape.specials()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = shape.config()
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": shape.max_position,
                        "bos_token": specials[config["bos_token_id"] - shape.regular_tokens],
                        "eos_token": specials[config["eos_token_id"] - shape.regular_tokens],
                        "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
