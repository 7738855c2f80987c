"""ModelConfig from GGUF metadata (`{arch}.*` hyperparameters, `tokenizer.ggml.*` special ids)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader

from llmpipe.config import ModelConfig
from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.models.gemma3.config import GEMMA3_DEFAULTS, gemma3_layer_types
from llmpipe.loader.gguf_file import find_tensor, metadata, tensor_shape
from llmpipe.loader.gguf_names import gguf_architecture
from llmpipe.loader.gguf_quants import dequantize
from llmpipe.loader.gguf_rope import llama3_scaling_from_factors, rope_scaling_from_metadata


def gguf_model_config(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = metadata(reader, path, "general.architecture")
    gguf_architecture(arch, path)  # raises for architectures we cannot serve

    def hp(key: str, *default: Any) -> Any:
        return metadata(reader, path, f"{arch}.{key}", *default)

    hidden, heads = int(hp("embedding_length")), int(hp("attention.head_count"))
    head_dim = int(hp("attention.key_length", hidden // heads))
    rope_dim = int(hp("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"{path}: partial rotary embeddings ({rope_dim} of {head_dim} dims)")
    rope_theta = float(hp("rope.freq_base", 10000.0))
    layers = int(hp("block_count"))
    return ModelConfig(
        architecture=arch,
        vocab_size=_vocab_size(reader, path, arch),
        hidden_size=hidden,
        intermediate_size=int(hp("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(hp("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(hp("context_length")),
        rms_norm_eps=float(hp("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, path, arch, rope_theta, head_dim),
        tie_word_embeddings=find_tensor(reader, "output.weight") is None,
        attention_bias=find_tensor(reader, "blk.0.attn_q.bias") is not None,
        qk_norm=find_tensor(reader, "blk.0.attn_q_norm.weight") is not None,
        sliding_window=hp("attention.sliding_window", None),  # llama.cpp stores none for the Llama family
        hidden_act="gelu_pytorch_tanh" if arch == "gemma3" else "silu",
        bos_token_id=metadata(reader, path, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=_eos_token_ids(reader, path, arch),
        **(_gemma3_fields(reader, path, layers) if arch == "gemma3" else {}),
    )


def _gemma3_fields(reader: GGUFReader, path: Path, layers: int) -> dict[str, Any]:
    """llama.cpp's Gemma 3 GGUF lacks the layer pattern, the local RoPE base and query_pre_attn_scalar:
    Gemma 3's published defaults fill them, as transformers does when it loads such a file."""
    return dict(
        layer_types=gemma3_layer_types(layers),
        rope_local_theta=GEMMA3_DEFAULTS["rope_local_theta"],
        query_pre_attn_scalar=GEMMA3_DEFAULTS["query_pre_attn_scalar"],
        final_logit_softcapping=metadata(reader, path, "gemma3.final_logit_softcapping", None),
    )


def _vocab_size(reader: GGUFReader, path: Path, arch: str) -> int:
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    size = metadata(reader, path, f"{arch}.vocab_size", None)
    if size is not None:
        return int(size)
    embedding = find_tensor(reader, "token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"{path}: no tokenizer.ggml.tokens, {arch}.vocab_size or token_embd.weight")
    return tensor_shape(embedding)[0]


# End-of-turn tokens llama.cpp also stops at, found by their text, for files that give no eot id.
_END_OF_TURN_TEXT = {"gemma3": "<end_of_turn>"}


def _eos_token_ids(reader: GGUFReader, path: Path, arch: str) -> tuple[int, ...]:
    ids = [metadata(reader, path, f"tokenizer.ggml.{key}", None) for key in ("eos_token_id", "eot_token_id")]
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if ids[1] is None and arch in _END_OF_TURN_TEXT and tokens is not None:
        text = _END_OF_TURN_TEXT[arch]
        ids.append(next((i for i in range(len(tokens.data)) if tokens.contents(i) == text), None))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _rope_scaling(reader: GGUFReader, path: Path, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    prefix = f"{arch}.rope.scaling."
    meta = {key[len(prefix) :]: reader.fields[key].contents() for key in reader.fields if key.startswith(prefix)}
    scaling = rope_scaling_from_metadata(meta)
    freqs = find_tensor(reader, "rope_freqs.weight")
    if scaling is None and freqs is not None:
        factors = dequantize(torch.from_numpy(freqs.data), freqs.tensor_type, tensor_shape(freqs))
        scaling = llama3_scaling_from_factors(factors, theta, head_dim, path)
    return scaling
