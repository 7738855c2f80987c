"""Writing small GGUF files for loader tests, the way llama.cpp's convert_hf_to_gguf.py does.

Names come from the gguf package's own tensor map and the Q/K permutation is llama.cpp's, so the
files are an independent reference for llmpipe's name tables and un-permutation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

# The GGUF architecture llama.cpp gives each tiny Hugging Face config (Mistral GGUFs say "llama").
GGUF_ARCH_OF = {"llama_gqa": "llama", "llama_mha": "llama", "llama_mqa": "llama", "mistral": "llama",
                "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
             "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE}
TensorSpec = np.ndarray | tuple[np.ndarray, GGMLQuantizationType]
# A Llama whose every linear layer's rows are whole 256-weight super-blocks (K-quants, IQ4_XS).
WIDE_LLAMA = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim in behaviour."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, TensorSpec]) -> Path:
    """Float32/float16 arrays are stored as is; (array, type) pairs are quantized by gguf.quants, or
    written as they are where the array is uint8: raw blocks [rows, bytes per row] of that type."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, spec in tensors.items():
        if isinstance(spec, tuple):
            data, qtype = spec
            raw = data if data.dtype == np.uint8 else gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, spec)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_metadata(config: Any, arch: str) -> dict[str, Any]:
    """The `{arch}.*` hyperparameters llama.cpp writes for a transformers config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ({  # none where every layer is a mixture of experts (Qwen3.5-MoE)
        f"{arch}.feed_forward_length": config.intermediate_size,
    } if hasattr(config, "intermediate_size") else {}) | {
        f"{arch}.block_count": config.num_hidden_layers,
        f"{arch}.context_length": config.max_position_embeddings,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.attention.head_count": config.num_attention_heads,
        f"{arch}.attention.head_count_kv": config.num_key_value_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{arch}.vocab_size": config.vocab_size,
        "tokenizer.ggml.bos_token_id": config.bos_token_id,
        "tokenizer.ggml.eos_token_id": config.eos_token_id,
    } | ({  # a mixture of experts' counts, as the converter's set_gguf_parameters writes them
        f"{arch}.expert_count": config.num_experts,
        f"{arch}.expert_used_count": config.num_experts_per_tok,
        f"{arch}.expert_feed_forward_length": config.moe_intermediate_size,
    } if hasattr(config, "moe_intermediate_size") else {}) | ({
        f"{arch}.expert_shared_feed_forward_length": config.shared_expert_intermediate_size,
    } if getattr(config, "shared_expert_intermediate_size", None) else {})


def split_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused 3-D experts ([experts, 2 × inner, hidden] gate | up; down) as the converter's
    Qwen2MoeModel.modify_tensors splits them: gate, up and down, each [experts, out, in]."""
    tensors = {}
    for name, weight in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = weight.chunk(2, dim=1)
            prefix = name.removesuffix("gate_up_proj")
            tensors |= {f"{prefix}gate_proj.weight": gate, f"{prefix}up_proj.weight": up}
        elif name.endswith("mlp.experts.down_proj"):
            tensors[f"{name}.weight"] = weight
        else:
            tensors[name] = weight
    return tensors


def hf_tensors(
    state_dict: dict[str, torch.Tensor], config: Any, arch: str, qtypes: dict[str, GGMLQuantizationType]
) -> dict[str, TensorSpec]:
    """GGUF-named tensors from a Hugging Face state dict; `qtypes` quantizes chosen HF names."""
    name_map = gguf.get_tensor_name_map(GGUF_ARCH[arch], config.num_hidden_layers)
    tensors: dict[str, TensorSpec] = {}
    for hf_name, weight in split_experts(state_dict).items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = weight.float().numpy()
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            data = llama_cpp_permute(data, config.num_attention_heads, config.num_attention_heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            data = llama_cpp_permute(data, config.num_attention_heads, config.num_key_value_heads)
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        tensors[name] = (data, qtypes[hf_name]) if hf_name in qtypes else data
    return tensors


def wide_llama(seed: int = 0) -> tuple[dict[str, Any], dict[str, TensorSpec]]:
    """The metadata and float32 GGUF tensors of a random-weight WIDE_LLAMA (no tokenizer: prompts are ids)."""
    import transformers

    config = transformers.LlamaConfig(**WIDE_LLAMA)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.05)
    return hf_metadata(config, "llama"), hf_tensors(model.state_dict(), config, "llama", {})


def llama_cpp_rope_freqs(theta: float, dim: int, scaling: dict[str, float]) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for a "llama3" rope_scaling, loop and all."""
    import math

    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)
