"""Hugging Face directories: config.json fields and safetensors weights against transformers."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from llmpipe.loader import load_checkpoint
from tests.utils import TINY_CONFIGS, reference_state_dict


def edited_copy(source: Path, target: Path, **changes) -> Path:
    """A copy of a checkpoint directory with config.json keys changed (None deletes a key)."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (target / "config.json").write_text(json.dumps(config))
    return target


def assert_weights_equal_state_dict(checkpoint, model) -> None:
    reference = reference_state_dict(model)
    weights = dict(checkpoint.iter_weights())
    assert set(weights) == set(reference)
    for name, weight in weights.items():
        assert weight.dtype == reference[name].dtype, name
        assert torch.equal(weight, reference[name]), name


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_weights_equal_the_transformers_state_dict(name, tiny_checkpoint, transformers_model):
    assert_weights_equal_state_dict(load_checkpoint(str(tiny_checkpoint(name))), transformers_model(name))


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_config_matches_the_transformers_config(name, tiny_checkpoint, transformers_model):
    checkpoint = load_checkpoint(str(tiny_checkpoint(name)))
    config, hf = checkpoint.config, transformers_model(name).config
    assert config.architecture == hf.model_type
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                  "bos_token_id"):
        assert getattr(config, field) == getattr(hf, field), field
    gemma = hf.model_type == "gemma3_text"
    assert config.hidden_act == (hf.hidden_activation if gemma else hf.hidden_act)
    assert config.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    rope = dict(hf.rope_parameters["full_attention"] if gemma else hf.rope_parameters)
    assert config.rope_theta == rope.pop("rope_theta")
    assert config.rope_scaling == (None if rope["rope_type"] == "default" else rope)
    if gemma:  # local layers: their own RoPE base, the window; global ones: full attention
        assert config.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
        assert config.layer_types == tuple(hf.layer_types)
    assert config.attention_bias == (hf.model_type in ("qwen2", "qwen2_moe", "gpt_oss"))
    assert config.qk_norm == (hf.model_type in ("qwen3", "qwen3_moe", "gemma3_text", "qwen3_5_text", "qwen3_5_moe_text",
                                                "qwen3_next"))
    assert config.sliding_window == (hf.sliding_window if hf.model_type in ("mistral", "gemma3_text", "gpt_oss") else None)
    assert config.eos_token_ids == (2,)
    assert checkpoint.path == tiny_checkpoint(name).resolve()
    assert checkpoint.file_bytes == (checkpoint.path / "model.safetensors").stat().st_size
    assert checkpoint.tokenizer is not None


def test_sharded_safetensors_directory_loads(transformers_model, tmp_path):
    model = transformers_model("qwen2")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2
    checkpoint = load_checkpoint(str(tmp_path))
    assert checkpoint.file_bytes == sum(s.stat().st_size for s in shards)
    assert checkpoint.tokenizer is None  # no tokenizer files saved
    assert_weights_equal_state_dict(checkpoint, model)


def test_bfloat16_checkpoint_keeps_its_dtype(transformers_model, tmp_path):
    model = transformers_model("llama_gqa")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path)  # the cached model stays float32
    weights = dict(load_checkpoint(str(tmp_path)).iter_weights())
    embed = weights["model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16
    assert torch.equal(embed, model.state_dict()["model.embed_tokens.weight"].bfloat16())


def test_generation_config_eos_ids_merge_with_config_eos(tiny_checkpoint, tmp_path):
    directory = edited_copy(tiny_checkpoint("llama_gqa"), tmp_path / "ckpt", eos_token_id=[2, 5])
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2], "bos_token_id": 1}))
    assert load_checkpoint(str(directory)).config.eos_token_ids == (2, 5, 7)


def test_legacy_rope_theta_and_rope_scaling_spelling(tiny_checkpoint, tmp_path):
    directory = edited_copy(
        tiny_checkpoint("llama_gqa"), tmp_path / "ckpt",
        rope_parameters=None, rope_theta=250000.0, rope_scaling={"type": "linear", "factor": 2.0},
    )
    config = load_checkpoint(str(directory)).config
    assert config.rope_theta == 250000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_head_dim_defaults_to_hidden_over_heads(tiny_checkpoint, tmp_path):
    directory = edited_copy(tiny_checkpoint("llama_gqa"), tmp_path / "ckpt", head_dim=None)
    assert load_checkpoint(str(directory)).config.head_dim == 64 // 4


@pytest.mark.parametrize(
    ("name", "changes", "window"),
    [
        ("mistral", {"sliding_window": 4096}, 4096),
        ("qwen2", {"sliding_window": 4096, "use_sliding_window": False}, None),
        ("qwen2", {"sliding_window": 4096, "use_sliding_window": True}, 4096),
    ],
)
def test_sliding_window_only_where_the_architecture_uses_it(name, changes, window, tiny_checkpoint, tmp_path):
    directory = edited_copy(tiny_checkpoint(name), tmp_path / "ckpt", **changes)
    assert load_checkpoint(str(directory)).config.sliding_window == window
