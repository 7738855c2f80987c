"""ModelConfig from GGUF metadata (`{arch}.*` hyperparameters, `tokenizer.ggml.*` special ids)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader

from llmpipe.config import ModelConfig
from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.loader.gguf_file import find_tensor, metadata, tensor_shape
from llmpipe.loader.gguf_quants import dequantize
from llmpipe.loader.gguf_rope import llama3_scaling_from_factors, rope_scaling_from_metadata
from llmpipe.models import registry  # a module, not its names: the families import loader modules in turn


def gguf_model_config(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = metadata(reader, path, "general.architecture")
    table = registry.gguf_architecture(arch, path)  # raises for architectures we cannot serve

    def hp(key: str, *default: Any) -> Any:
        return metadata(reader, path, f"{arch}.{key}", *default)

    hidden, heads = int(hp("embedding_length")), int(hp("attention.head_count"))
    head_dim = int(hp("attention.key_length", hidden // heads))
    rope_dim = int(hp("rope.dimension_count", head_dim))
    if rope_dim != head_dim and not table.partial_rotary:
        raise UnsupportedModelError(f"{path}: partial rotary embeddings ({rope_dim} of {head_dim} dims)")
    rope_theta = float(hp("rope.freq_base", 10000.0))
    common = dict(
        architecture=arch,
        vocab_size=_vocab_size(reader, path, arch),
        hidden_size=hidden,
        # a mixture of experts without dense layers may give only its experts' (qwen35moe)
        intermediate_size=int(hp("feed_forward_length", None) or hp("expert_feed_forward_length")),
        num_hidden_layers=int(hp("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(hp("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(hp("context_length")),
        rms_norm_eps=float(hp("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, path, arch, rope_theta, head_dim),
        tie_word_embeddings=find_tensor(reader, "output.weight") is None,
        attention_bias=any(find_tensor(reader, f"blk.0.attn_{t}.bias") is not None for t in ("q", "qkv")),  # --fuse-qkv's
        qk_norm=find_tensor(reader, "blk.0.attn_q_norm.weight") is not None,
        sliding_window=hp("attention.sliding_window", None),  # llama.cpp stores none for the Llama family
        bos_token_id=metadata(reader, path, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=_eos_token_ids(reader, path, table.end_of_turn),
        pooling=GGUF_POOLING.get(hp("pooling_type", None)),
    )
    return ModelConfig(**(common | registry.family_of(arch).gguf_fields(hp)))


# llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last (4, rank: a cls.output head, not read).
GGUF_POOLING = {1: "mean", 2: "cls", 3: "lasttoken"}


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


def _eos_token_ids(reader: GGUFReader, path: Path, end_of_turn: str | None) -> tuple[int, ...]:
    ids = [metadata(reader, path, f"tokenizer.ggml.{key}", None) for key in ("eos_token_id", "eot_token_id")]
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if ids[1] is None and end_of_turn is not None and tokens is not None:
        ids.append(next((i for i in range(len(tokens.data)) if tokens.contents(i) == end_of_turn), None))
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
