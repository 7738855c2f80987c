"""hf_config_dict writes the config.json that hf_model_config (and transformers) read back."""

import json

import pytest
import transformers

from llmpipe.loader import load_checkpoint
from llmpipe.loader.hf_config import hf_config_dict, hf_model_config
from llmpipe.models.llama import LLAMA_FAMILY
from tests.utils import TINY_CONFIGS

LLAMA_CONFIGS = sorted(name for name, (cls, _) in TINY_CONFIGS.items() if cls[: -len("Config")].lower() in LLAMA_FAMILY)
MOE_CONFIGS = ["qwen2_moe", "qwen3_moe"]


def write_and_read(config, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(config)))
    return hf_model_config(tmp_path)


@pytest.mark.parametrize("name", LLAMA_CONFIGS + MOE_CONFIGS)
def test_config_json_round_trips(tiny_checkpoint, tmp_path, name):
    config = hf_model_config(tiny_checkpoint(name))
    assert write_and_read(config, tmp_path) == config
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    original = transformers.AutoConfig.from_pretrained(tiny_checkpoint(name))
    for key in ("model_type", "hidden_size", "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps", "rope_parameters"):
        assert getattr(theirs, key) == getattr(original, key), key


@pytest.mark.slow
def test_smollm2_gguf_config_round_trips(smollm2_gguf, tmp_path):
    config = load_checkpoint(str(smollm2_gguf)).config
    assert write_and_read(config, tmp_path) == config
