"""PEFT adapters on llmpipe's model against PEFT's own merged model (transformers, float32), and the adapters
llmpipe refuses."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmpipe import LLM
from llmpipe.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from llmpipe.lora import LoRAManager, peft_adapter
from tests.lora.helpers import hf_model, merged_logits, save_peft_adapter
from tests.utils import build_checkpoint

TOKENS = [1, 17, 250, 33, 91, 5, 160, 77, 300, 12, 64, 128, 3, 99]


def adapted_logits(llm, manager: LoRAManager, name: str | None, tokens: list[int] = TOKENS) -> torch.Tensor:
    with manager.step([name] * len(tokens)):
        return llm.engine.score(tokens)


@pytest.mark.parametrize("config", [
    dict(r=8, alpha=16),
    dict(r=4, alpha=8, targets=["q_proj", "v_proj"]),  # two of qkv_proj's three shards; nothing in the MLP
    dict(r=8, alpha=4, targets=["k_proj", "up_proj", "down_proj"], use_rslora=True),
    dict(r=6, alpha=12, rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 3.0}),
], ids=["all_linear", "q_and_v", "rslora", "patterns"])
def test_adapted_logits_equal_peft_merged_model(lora_base, lora_llm, tmp_path, config):
    base_dir, base = lora_base
    config = dict(config)
    r, alpha = config.pop("r"), config.pop("alpha")
    adapter = save_peft_adapter(base, tmp_path / "adapter", seed=3, r=r, alpha=alpha, **config)
    manager = LoRAManager(lora_llm.engine.model, max_loras=2, max_lora_rank=8)
    manager.load("a", adapter)
    expected = merged_logits(base, adapter, TOKENS)
    assert (expected - merged_logits(base, None, TOKENS)).abs().max() > 0.05  # the adapter matters
    torch.testing.assert_close(adapted_logits(lora_llm, manager, "a"), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(adapted_logits(lora_llm, manager, None), merged_logits(base, None, TOKENS), atol=1e-4, rtol=0)


def test_q_and_v_adapter_leaves_k_rows_and_mlp_alone(lora_base, lora_llm, tmp_path):
    adapter = save_peft_adapter(lora_base[1], tmp_path / "qv", seed=4, r=4, targets=["q_proj", "v_proj"])
    manager = LoRAManager(lora_llm.engine.model, max_loras=1, max_lora_rank=4)
    loaded = manager.load("qv", adapter)
    assert set(loaded.modules) == {f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)}
    attn = lora_llm.engine.model.model.layers[0].self_attn
    delta = loaded.modules["model.layers.0.self_attn.qkv_proj"].delta_weight()
    k_rows = slice(attn.q_size, attn.q_size + attn.kv_size)
    assert delta.shape == (attn.q_size + 2 * attn.kv_size, 64) and delta[k_rows].abs().max() == 0
    assert delta[: attn.q_size].abs().max() > 0 and delta[attn.q_size + attn.kv_size :].abs().max() > 0


def test_unloading_frees_the_slot_and_the_model_is_the_base_again(lora_base, lora_llm, tmp_path):
    base = lora_base[1]
    manager = LoRAManager(lora_llm.engine.model, max_loras=1, max_lora_rank=8)
    manager.load("one", save_peft_adapter(base, tmp_path / "one", seed=5))
    with pytest.raises(InvalidRequestError, match="max_loras"):
        manager.load("two", save_peft_adapter(base, tmp_path / "two", seed=6))
    manager.unload("one")
    assert manager.names() == []
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'one'"):
        adapted_logits(lora_llm, manager, "one")
    manager.load("two", tmp_path / "two")
    torch.testing.assert_close(adapted_logits(lora_llm, manager, "two"), merged_logits(base, tmp_path / "two", TOKENS),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(lora_llm.engine.score(TOKENS), merged_logits(base, None, TOKENS), atol=1e-4, rtol=0)


# ---- refusals ---------------------------------------------------------------------------------------------------

def edited(tmp_path, source, config_changes: dict | None = None, tensor_changes: dict | None = None):
    """A copy of a saved PEFT adapter with config keys and tensors added or replaced."""
    out = tmp_path / "edited"
    out.mkdir()
    config = json.loads((source / "adapter_config.json").read_text()) | (config_changes or {})
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(load_file(source / "adapter_model.safetensors") | (tensor_changes or {}), out / "adapter_model.safetensors")
    return out


@pytest.fixture(scope="module")
def good_adapter(lora_base, tmp_path_factory):
    return save_peft_adapter(lora_base[1], tmp_path_factory.mktemp("good"), seed=7, r=8, targets=["q_proj", "v_proj"])


def refusal(lora_llm, path, error, max_lora_rank: int = 8) -> str:
    manager = LoRAManager(lora_llm.engine.model, max_loras=1, max_lora_rank=max_lora_rank)
    with pytest.raises(error) as info:
        manager.load("bad", path)
    assert manager.names() == [] and "\n" not in str(info.value)
    return str(info.value)


def test_rank_above_max_lora_rank_is_refused(lora_llm, good_adapter):
    message = refusal(lora_llm, good_adapter, InvalidRequestError, max_lora_rank=4)
    assert "rank 8, above max_lora_rank 4" in message


def test_factors_of_the_wrong_shape_are_refused_before_they_are_read(lora_llm, good_adapter, tmp_path, monkeypatch):
    wide = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 4096)}
    path = edited(tmp_path, good_adapter, tensor_changes=wide)
    read = []
    original = peft_adapter.safe_open

    class Spy:  # safe_open whose get_tensor records what was read
        def __init__(self, *args, **kwargs):
            self.inner = original(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, key):
            return self.file.get_slice(key)

        def get_tensor(self, key):
            read.append(key)
            return self.file.get_tensor(key)

    monkeypatch.setattr(peft_adapter, "safe_open", Spy)
    assert "has shape (8, 4096)" in refusal(lora_llm, path, UnsupportedModelError)
    assert read == []


def test_dora_is_refused(lora_llm, good_adapter, tmp_path):
    assert "DoRA" in refusal(lora_llm, edited(tmp_path, good_adapter, {"use_dora": True}), UnsupportedModelError)


def test_dora_magnitudes_without_the_flag_are_refused(lora_llm, good_adapter, tmp_path):
    magnitude = {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(256)}
    assert "DoRA" in refusal(lora_llm, edited(tmp_path, good_adapter, tensor_changes=magnitude), UnsupportedModelError)


def test_modules_to_save_is_refused(lora_llm, good_adapter, tmp_path):
    path = edited(tmp_path, good_adapter, {"modules_to_save": ["lm_head"]})
    assert "modules_to_save" in refusal(lora_llm, path, UnsupportedModelError)


@pytest.mark.parametrize("module", ["model.layers.0.mlp.fc9", "lm_head", "model.embed_tokens"])
def test_unknown_or_unadapted_targets_are_refused(lora_llm, good_adapter, tmp_path, module):
    pair = {f"base_model.model.{module}.lora_A.weight": torch.zeros(8, 64),
            f"base_model.model.{module}.lora_B.weight": torch.zeros(64, 8)}
    message = refusal(lora_llm, edited(tmp_path, good_adapter, tensor_changes=pair), UnsupportedModelError)
    assert module in message


def test_missing_files_and_pickles_are_refused_without_unpickling(lora_llm, good_adapter, tmp_path):
    assert "no such LoRA adapter" in refusal(lora_llm, tmp_path / "absent", ModelLoadError)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text((good_adapter / "adapter_config.json").read_text())
    assert "no adapter_model.safetensors" in refusal(lora_llm, no_weights, ModelLoadError)
    (no_weights / "adapter_model.bin").write_bytes(b"not a pickle llmpipe may open")
    assert "pickle" in refusal(lora_llm, no_weights, UnsupportedModelError)
    assert "no adapter_config.json" in refusal(lora_llm, tmp_path, ModelLoadError)


FAMILIES = {  # a tiny checkpoint per family (Phi-3's own checkpoints fuse qkv and gate_up: PEFT targets them so)
    "phi3": ("Phi3Config", dict(pad_token_id=0, num_attention_heads=4, num_key_value_heads=2),
             ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32), None),
    "mistral_window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=12), None),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adapters_of_other_families_equal_peft_merged_model(family, tmp_path):
    config, extra, targets = FAMILIES[family]
    path = build_checkpoint(config, extra, tmp_path / "base")
    base = hf_model(path)
    adapter = save_peft_adapter(base, tmp_path / "adapter", seed=3, **({"targets": targets} if targets else {}))
    with LLM(str(path), dtype="float32", progress=False) as llm:
        manager = LoRAManager(llm.engine.model, max_loras=1, max_lora_rank=16)
        manager.load("a", adapter)
        with manager.step(["a"], [len(TOKENS)]):
            logits = llm.engine.core.score(TOKENS)
    torch.testing.assert_close(logits, merged_logits(base, adapter, TOKENS), atol=1e-4, rtol=0)
