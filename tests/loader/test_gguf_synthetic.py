"""GGUF files written from the tiny transformers checkpoints, as llama.cpp's converter would."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmpipe.loader import load_checkpoint
from llmpipe.loader.gguf_rope import llama3_scaling_from_factors
from tests.loader.gguf_helpers import GGUF_ARCH_OF, hf_metadata, hf_tensors, llama_cpp_rope_freqs, write_gguf
from tests.utils import reference_state_dict


@pytest.mark.parametrize("name", sorted(GGUF_ARCH_OF))
def test_gguf_weights_equal_the_transformers_state_dict(name, tiny_gguf, transformers_model):
    checkpoint = load_checkpoint(str(tiny_gguf(name)))
    reference = reference_state_dict(transformers_model(name))
    weights = dict(checkpoint.iter_weights())
    assert set(weights) == set(reference)
    for key, weight in weights.items():
        assert torch.equal(weight, reference[key]), key


@pytest.mark.parametrize("name", sorted(GGUF_ARCH_OF))
def test_gguf_config_matches_the_transformers_config(name, tiny_gguf, transformers_model):
    config = load_checkpoint(str(tiny_gguf(name))).config
    hf = transformers_model(name).config
    assert config.architecture == GGUF_ARCH_OF[name]
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size)
    assert config.num_attention_heads == hf.num_attention_heads
    assert config.num_key_value_heads == hf.num_key_value_heads
    assert config.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert config.num_hidden_layers == hf.num_hidden_layers
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.attention_bias == (name in ("qwen2", "qwen2_moe"))
    assert config.qk_norm == (name in ("qwen3", "qwen3_moe"))
    assert config.rope_theta == hf.rope_parameters["rope_theta"] and config.rope_scaling is None
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1


def test_quantized_and_half_tensors_dequantize_and_unpermute(tiny_gguf, transformers_model):
    qtypes = {
        "model.layers.0.self_attn.q_proj.weight": Q.Q8_0,
        "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
        "model.layers.1.self_attn.k_proj.weight": Q.Q4_0,
        "model.layers.1.mlp.up_proj.weight": Q.BF16,
    }
    checkpoint = load_checkpoint(str(tiny_gguf("llama_gqa", qtypes)))
    reference = reference_state_dict(transformers_model("llama_gqa"))
    weights = dict(checkpoint.iter_weights())
    for key, qtype in qtypes.items():
        # Blocks lie within rows, so quantizing commutes with llama.cpp's row permutation.
        data = reference[key].numpy()
        expected = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype))
        assert torch.equal(weights[key].float(), expected.float()), key
    assert weights["model.layers.1.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32


def test_float16_gguf_tensors_stay_float16(tmp_path, transformers_model):
    model = transformers_model("qwen3")
    tensors = {k: v.astype(np.float16) if v.ndim == 2 else v
               for k, v in hf_tensors(model.state_dict(), model.config, "qwen3", {}).items()}
    path = write_gguf(tmp_path / "half.gguf", "qwen3", hf_metadata(model.config, "qwen3"), tensors)
    weights = dict(load_checkpoint(str(path)).iter_weights())
    embed = weights["model.embed_tokens.weight"]
    assert embed.dtype == torch.float16
    assert torch.equal(embed, model.state_dict()["model.embed_tokens.weight"].half())


def test_gguf_without_vocabulary_has_no_tokenizer(tiny_gguf):
    assert load_checkpoint(str(tiny_gguf("qwen2"))).tokenizer is None


def test_eot_token_joins_the_eos_ids(tiny_gguf):
    path = tiny_gguf("llama_gqa", **{"tokenizer.ggml.eot_token_id": 4})
    assert load_checkpoint(str(path)).config.eos_token_ids == (2, 4)


@pytest.mark.parametrize(
    "scaling",
    [
        dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),  # 3.1
        dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),  # 3.2
    ],
    ids=["llama3.1", "llama3.2"],
)
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(scaling):
    factors = torch.from_numpy(llama_cpp_rope_freqs(500000.0, 128, scaling))
    recovered = llama3_scaling_from_factors(factors, 500000.0, 128, Path("x.gguf"))
    assert recovered == {"rope_type": "llama3", **scaling}


def test_llama3_rope_freqs_tensor_becomes_rope_scaling(transformers_model, tmp_path):
    model = transformers_model("llama3_rope")
    params = dict(model.config.rope_parameters)
    theta = params.pop("rope_theta")
    tensors = hf_tensors(model.state_dict(), model.config, "llama", {})
    tensors["rope_freqs.weight"] = llama_cpp_rope_freqs(theta, 16, params)
    path = write_gguf(tmp_path / "llama3.gguf", "llama", hf_metadata(model.config, "llama"), tensors)
    config = load_checkpoint(str(path)).config
    assert config.rope_theta == theta
    assert config.rope_scaling == params  # includes rope_type "llama3"


def test_yarn_metadata_becomes_rope_scaling(tiny_gguf):
    path = tiny_gguf(
        "qwen2",
        **{"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
           "qwen2.rope.scaling.original_context_length": 256},
    )
    scaling = load_checkpoint(str(path)).config.rope_scaling
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


def test_progress_bar_goes_to_stderr_only_when_asked(tiny_gguf, capsys):
    checkpoint = load_checkpoint(str(tiny_gguf("qwen3")))
    capsys.readouterr()  # gguf-py's writer may have shown its own bar, making the file for this worker
    list(checkpoint.iter_weights())
    assert capsys.readouterr().err == ""
    list(checkpoint.iter_weights(progress=True))
    captured = capsys.readouterr()
    assert "qwen3.gguf" in captured.err and captured.out == ""
