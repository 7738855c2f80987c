"""Configuration: what the checkpoint is (ModelConfig) and how the engine runs it (EngineConfig)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from llmpipe.errors import InvalidRequestError


@dataclass
class ModelConfig:
    """Architecture-neutral hyperparameters, filled by the loaders from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Hugging Face `rope_scaling` dict ({"rope_type": "llama3", "factor": ..., ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral-style window; None = full attention
    # Per layer "sliding_attention" / "full_attention" (Gemma 3); None: every layer uses sliding_window.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers, where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (default head_dim)
    final_logit_softcapping: float | None = None  # logits = cap × tanh(logits / cap)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # A body without its LM head (what AutoModel saves: Qwen3-Embedding, e5-mistral): it embeds, never generates.
    embedding_only: bool = False
    # How its embeddings pool (mean, cls or lasttoken) where its file says so (a GGUF's pooling_type); None: the
    # sentence-transformers pipeline beside it, else the last token.
    pooling: str | None = None
    # The family's own hyperparameters, in a type of its own (DeepSeek V4: models/deepseek_v4/config.py's
    # DeepseekV4Fields); None for families that need none beyond these.
    extra: Any = None

    def layer_window(self, layer: int) -> int | None:
        """The attention window of one layer (None = full attention)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def attention_layers(self) -> int:
        """Layers that attend over a K/V cache (a hybrid's linear-attention layers keep a fixed state instead)."""
        if self.layer_types is None:
            return self.num_hidden_layers
        return sum(kind != "linear_attention" for kind in self.layer_types)

    @property
    def kv_elements_per_token(self) -> int:
        """K and V entries stored per token: 2 × attention layers × kv_heads × head_dim."""
        return 2 * self.attention_layers * self.num_key_value_heads * self.head_dim


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | float | str, name: str = "kv_cache_memory") -> int:
    """1073741824, 1.5e9, "512MiB", "2GiB", "4GB" → bytes (`name` is the option errors mention)."""
    if isinstance(value, (int, float)):
        number, unit = value, ""
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise InvalidRequestError(f"{name} must be bytes or a size like '2GiB', got {value!r}")
        number, unit = float(match.group(1)), match.group(2)
    size = int(float(number) * _UNITS[unit.lower()])
    if size <= 0:
        raise InvalidRequestError(f"{name} must be positive, got {value!r}")
    return size


DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATION_CHOICES = (None, "auto", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
KV_CACHE_DTYPES = ("auto", "int8", "int4")
ACTIVATION_QUANTIZATIONS = (None, "auto", "int8", "int16")
SPECULATIVE_METHODS = (None, "ngram", "draft")
TASKS = ("auto", "generate", "embed", "score")
MAX_SPECULATIVE_TOKENS = 16


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise InvalidRequestError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def option(default: Any, help: str, choices: tuple | None = None, cli: bool = True) -> Any:
    """An EngineConfig field and its documentation, from which engine_args.py makes the `--its-name` flag
    (`cli=False`: an option of the Python API only)."""
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


def lora_modules(items: Any) -> list[str] | None:
    """--lora-modules as "name=path" items: from such items, vLLM's JSON ({"name": ..., "path": ...}) or
    dicts of that shape, or one dict of name → path; a name given twice is an error."""
    if not items:
        return None
    if isinstance(items, dict):
        items = [f"{name}={path}" for name, path in items.items()]
    if isinstance(items, str):
        items = [items]
    out: dict[str, str] = {}
    for item in items:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as err:
                raise InvalidRequestError(f"lora_modules: {item!r} is not valid JSON ({err.msg})") from None
        if isinstance(item, dict):
            name, path = item.get("name"), item.get("path")
        elif isinstance(item, str) and "=" in item:
            name, _, path = item.partition("=")
        else:
            name = path = None
        if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
            raise InvalidRequestError(f"lora_modules: each item is name=path or {{\"name\": ..., \"path\": ...}}, "
                                      f"got {item!r}")
        if name.strip() in out:
            raise InvalidRequestError(f"lora_modules: the name {name.strip()!r} is given twice")
        out[name.strip()] = path.strip()
    return [f"{name}={path}" for name, path in out.items()]


@dataclass
class EngineConfig:
    """Every engine option, named like its CLI flag in snake_case (the flags are generated from these
    fields: llmpipe/engine_args.py). Derived values are filled at load."""

    model: str = option("smollm2-135m-instruct", "alias, Hugging Face directory or .gguf file")
    dtype: str = option("auto", "activations and float weights: auto = float32, with GGUF weights of the types "
                        "the kernels run (NATIVE_FORMATS) kept quantized; an explicit dtype dequantizes them",
                        tuple(DTYPES))
    device: str = option("cpu", "cpu, or cuda / cuda:N (PyTorch's device)")
    max_model_len: int | None = option(None, "context length (default: the model's, capped by the KV pool)")
    kv_cache: bool = option(True, "False recomputes the whole sequence every step (for the benchmark)", cli=False)
    kv_cache_memory: int | float | str = option(
        "auto", "KV cache budget: bytes or a size like 512MiB, 2GiB; auto: 1 GiB, or half the memory left beside "
        "the weights where that is less (loader/memory_check.auto_kv_pool)")
    max_num_blocks: int | None = option(None, "KV cache blocks (overrides --kv-cache-memory)")
    block_size: int = option(16, "tokens per KV cache block")
    max_num_seqs: int = option(128, "sequences running at once at most")
    max_num_batched_tokens: int | None = option(
        None, "tokens one step computes at most (default: 2048, halved down to 512 while a step's activations would "
        "pass 192 MiB: 512 for a 7B-8B, as llama.cpp's n_ubatch; engine/step_size.py)")
    max_decode_stall: float | None = option(
        None, "keep a step with prefill chunks beside running decodes to about this many times a decode-only step "
        "of the running and waiting sequences (measured as it runs: engine/step_costs.py), so new prompts do not "
        "stall the streams; none: prefill takes the whole token budget (`serve` default 2.5)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes computed before")
    kv_offload_memory: int | float | str = option(
        0, "a prefix-cache tier in host memory below the KV pool: every cached block is saved there once, and one "
        "the pool evicted comes back from it instead of being recomputed (kv_cache/offload_tier.py); bytes or a "
        "size like 4GiB; 0: none")
    kv_offload_dir: str | None = option(
        None, "a disk tier below that (or alone): one checksummed file per block, in a folder per model and cache "
        "layout, that outlives restarts; a torn or corrupt file is recomputed, never served")
    kv_offload_disk: int | float | str = option("16GiB", "most bytes the disk tier keeps (least recently used go first)")
    disable_sliding_window: bool = option(
        False, "full attention in every layer, ignoring the model's sliding windows (to measure what they save; "
        "outputs differ once a sequence is longer than a window)")
    num_threads: int | None = option(None, "compute threads (default: PyTorch's)")
    seed: int | None = option(None, "seeds torch's generator when the engine starts, as vLLM's LLM(seed=...): what "
                              "requests without a seed of their own draw from (a request's seed: SamplingParams)", cli=False)
    quantization: str | None = option(
        "auto", "weights: auto keeps the GGUF types of loader/gguf_weights.NATIVE_FORMATS quantized and dequantizes "
        "the rest; none keeps the checkpoint's precision in --dtype; int8 / int4 quantize at load (round to "
        "nearest)", QUANTIZATION_CHOICES)
    group_size: int = option(128, "int4 group along the input dimension", INT4_GROUP_SIZES)
    kv_cache_dtype: str = option("auto", "KV cache: auto (= dtype), int8 or int4", KV_CACHE_DTYPES)
    activation_quantization: str | None = option(
        "auto", "how quantized weights meet activations: int16 / int8 blocks in integer dot products, in every row "
        "of a step (int16: exact to float32 rounding, the same perplexity and greedy tokens; int8: llama.cpp's, "
        "approximate); none: float activations (the exact reference); auto: int16 where the integer-dot kernels "
        "run, else none", ACTIVATION_QUANTIZATIONS)
    float_batch_weights: bool = option(
        False, "also keep quantized weights as float32 for batches of FLOAT_BATCH_MIN_ROWS rows or more: the "
        "float GEMM on the same weight values, for ~4.8x the weight memory of Q4 (with activation quantization "
        "it serves scoring only: engine.score, prompt logprobs)")
    tensor_parallel_size: int = option(
        1, "shard the model over N processes (torch.distributed); --kv-cache-memory and --num-threads are then per "
        "rank (threads default: this machine's shared out among the ranks)")
    distributed_timeout_s: float = option(120.0, "a collective (or a tensor-parallel rank) silent this long is a failure")
    task: str = option(
        "auto", "what the model serves: a decoder generates and embeds (last-token pooling) under auto, generate or "
        "embed; score makes it a reranker (P(yes) against no, as Qwen3-Reranker; auto does so where the model's name "
        "says reranker); an encoder (BERT, EmbeddingGemma, cross-encoders) serves its own head", TASKS)
    speculative_method: str | None = option(
        None, "speculative decoding: ngram (prompt lookup) or draft (--speculative-model decodes the proposals; "
        "the default when a speculative model is given); none: off", SPECULATIVE_METHODS)
    speculative_model: str | None = option(None, "draft model sharing the target's tokenizer (implies draft)")
    speculative_quantization: str | None = option("auto", "the draft's weights, as --quantization", QUANTIZATION_CHOICES)
    num_speculative_tokens: int = option(4, "k: tokens proposed per step")
    prompt_lookup_min: int = option(2, "shortest n-gram the ngram method matches")
    prompt_lookup_max: int = option(4, "longest n-gram the ngram method matches (tried first)")
    enable_lora: bool = option(
        False, "serve LoRA adapters over the base model (docs/features/lora.md): a request names one as its model; "
        "adapters load at start (--lora-modules) or at run time (POST /v1/load_lora_adapter)")
    max_loras: int = option(4, "LoRA adapters one step may mix (their slots); more may be loaded: a request under "
                            "another waits for a slot, which the least recently used adapter no running request "
                            "uses gives up (vLLM's --max-loras)")
    max_lora_rank: int = option(16, "the highest LoRA rank an adapter may have")
    lora_modules: list[str] | None = option(
        None, "LoRA adapters to load at start: name=path items (a PEFT directory or a GGUF LoRA file), or vLLM's "
        "JSON {\"name\": ..., \"path\": ...}; implies --enable-lora")
    # Filled from the checkpoint at load time.
    model_config: ModelConfig | None = field(default=None, repr=False, metadata={"cli": False})

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_model_len", "max_num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        if self.max_decode_stall is not None and not (isinstance(self.max_decode_stall, (int, float))
                                                      and self.max_decode_stall > 1):
            raise InvalidRequestError(f"max_decode_stall must be a number > 1 (or None), got {self.max_decode_stall!r}")
        if not isinstance(self.distributed_timeout_s, (int, float)) or self.distributed_timeout_s <= 0:
            raise InvalidRequestError(f"distributed_timeout_s must be a positive number, got {self.distributed_timeout_s!r}")
        if self.kv_cache_memory != "auto":
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.kv_offload_memory not in (0, "0", None):
            self.kv_offload_memory = parse_bytes(self.kv_offload_memory, "kv_offload_memory")
        parse_bytes(self.kv_offload_disk, "kv_offload_disk")  # checked now, kept as given (the flag's default)
        if self.kv_offload and not self.enable_prefix_caching:
            raise InvalidRequestError("kv_offload_memory / kv_offload_dir keep prefix-cache blocks: they need "
                                      "enable_prefix_caching")
        if self.kv_offload and self.tensor_parallel_size > 1:
            raise InvalidRequestError("the KV offload tier runs with tensor_parallel_size 1 only (each rank would "
                                      "need a tier of its own)")
        _check_choice("quantization", self.quantization, QUANTIZATION_CHOICES)
        _check_choice("group_size", self.group_size, INT4_GROUP_SIZES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("activation_quantization", self.activation_quantization, ACTIVATION_QUANTIZATIONS)
        _check_choice("task", self.task, TASKS)
        self._check_speculation()
        self._check_lora()

    def _check_speculation(self) -> None:
        if self.speculative_model is not None and self.speculative_method is None:
            self.speculative_method = "draft"
        _check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
        _check_choice("speculative_quantization", self.speculative_quantization, QUANTIZATION_CHOICES)
        if self.speculative_method == "draft" and self.speculative_model is None:
            raise InvalidRequestError("speculative_method='draft' needs a speculative_model")
        if self.speculative_method == "ngram" and self.speculative_model is not None:
            raise InvalidRequestError("speculative_method='ngram' proposes from the sequence itself: drop speculative_model")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= MAX_SPECULATIVE_TOKENS:
                raise InvalidRequestError(f"{name} must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )

    def _check_lora(self) -> None:
        self.lora_modules = lora_modules(self.lora_modules)
        if self.lora_modules:
            self.enable_lora = True
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise InvalidRequestError("LoRA adapters run with tensor_parallel_size 1 only")
        if self.enable_lora and self.speculative_method is not None:
            raise InvalidRequestError("LoRA adapters do not run with speculative decoding (the draft has no adapter)")

    @property
    def lora_paths(self) -> dict[str, str]:
        """The adapters to load at start: name → path."""
        return dict(item.partition("=")[::2] for item in self.lora_modules or ())

    @property
    def kv_offload(self) -> bool:
        """Whether the prefix cache has a tier below the KV pool."""
        return self.kv_offload_memory not in (0, "0", None) or self.kv_offload_dir is not None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def weight_quantization(self) -> str | None:
        """"auto" keeps a GGUF's NATIVE_FORMATS tensors quantized unless a float dtype was asked for."""
        if self.quantization == "auto":
            return "auto" if self.dtype == "auto" else None
        return self.quantization

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls) if f.name != "model_config"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)
