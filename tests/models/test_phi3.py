"""Phi-3 / Phi-3.5 against transformers on tiny random-weight checkpoints (float32): fused qkv and gate_up
tensors, default RoPE, LongRoPE (short of and past original_max_position_embeddings), partial RoPE with tied
embeddings, and a sliding window shorter than the prompts; prefill, decode, chunked prefill and batched runs."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import transformers

from llmpipe import LLM
from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.loader.hf_config import hf_model_config
from llmpipe.models.phi3 import PHI3
from llmpipe.models.registry import family_of
from tests.models.parity_suite import *  # noqa: F403  (the shared parity tests)
from tests.models.parity_suite import PROMPT
from tests.utils import (assert_greedy_run_matches, build_checkpoint, prompt, reference_case,
                         reference_greedy)

ORIGINAL = 64  # original_max_position_embeddings of the LongRoPE checkpoints


def factors(count: int, start: float, step: float) -> list[float]:
    return [start + i * step for i in range(count)]


LONGROPE = dict(rope_type="longrope", short_factor=factors(8, 1.0, 0.15), long_factor=factors(8, 1.5, 1.0))
VARIANTS = {
    "default": dict(num_attention_heads=4, num_key_value_heads=2),
    # max 256 / original 64: attention factor sqrt(1 + ln 4 / ln 64)
    "longrope": dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     original_max_position_embeddings=ORIGINAL, rope_parameters=LONGROPE),
    # Phi-4-mini's shape: RoPE on part of each head (8 of 16 channels), tied embeddings, LongRoPE
    "partial": dict(num_attention_heads=4, num_key_value_heads=1, partial_rotary_factor=0.5, tie_word_embeddings=True,
                    max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
                    rope_parameters=dict(LONGROPE, short_factor=factors(4, 1.0, 0.2), long_factor=factors(4, 2.0, 1.5))),
    # transformers 5 masks Phi-3 attention to config.sliding_window (here shorter than the prompts); so does llmpipe
    "window": dict(num_attention_heads=4, num_key_value_heads=4, sliding_window=12),
}




@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def make(name: str):
        if name not in cache:
            extra = dict(pad_token_id=0, **VARIANTS[name])
            cache[name] = build_checkpoint("Phi3Config", extra, tmp_path_factory.mktemp(f"phi3_{name}"))
        return cache[name]

    return make


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, checkpoints):
    return reference_case(checkpoints(request.param))


@pytest.mark.parametrize("chunk", [2048, 24])
def test_longrope_past_the_original_length_matches_transformers_stepped_on_its_cache(checkpoints, chunk):
    """A 90-token prompt (crossing 64 inside prefill) and 32 tokens more: long factors from position 64 on."""
    path = checkpoints("longrope")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = prompt(90, 7)
    llm = LLM(str(path), progress=False, max_num_batched_tokens=chunk)
    assert_greedy_run_matches(llm, tokens, reference_greedy(reference, tokens, 32, one_by_one=True))


def test_config_normalizes_longrope_and_partial_rotary(checkpoints):
    config = hf_model_config(checkpoints("partial"))
    assert family_of(config.architecture) is PHI3
    assert config.extra.rotary_dim == 8 and config.head_dim == 16 and config.tie_word_embeddings
    assert config.rope_scaling == dict(
        rope_type="longrope", short_factor=factors(4, 1.0, 0.2), long_factor=factors(4, 2.0, 1.5),
        original_max_position_embeddings=ORIGINAL, attention_factor=math.sqrt(1 + math.log(4) / math.log(ORIGINAL)))
    assert hf_model_config(checkpoints("default")).rope_scaling is None


def rewrite_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


def test_legacy_su_spelling_reads_as_longrope(checkpoints, tmp_path):
    src = checkpoints("longrope")
    legacy = rewrite_config(src, tmp_path / "su", rope_parameters=None, rope_theta=10000.0,
                            rope_scaling={"type": "su", "short_factor": LONGROPE["short_factor"],
                                          "long_factor": LONGROPE["long_factor"]})
    assert hf_model_config(legacy).rope_scaling == hf_model_config(src).rope_scaling


@pytest.mark.parametrize(("rope", "message"), [
    ({"rope_type": "dynamic", "factor": 2.0}, r"Phi-3 RoPE scaling 'dynamic' is not supported"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8},
     r"longrope short_factor must be a list of 8 numbers"),
])
def test_unsupported_or_broken_rope_is_refused_clearly(checkpoints, tmp_path, rope, message):
    bad = rewrite_config(checkpoints("default"), tmp_path / "bad", rope_parameters={"rope_theta": 10000.0, **rope})
    with pytest.raises(ModelLoadError, match=message):  # UnsupportedModelError is a ModelLoadError
        LLM(str(bad), progress=False)


def test_tensor_parallelism_is_refused(checkpoints):
    with pytest.raises(UnsupportedModelError, match="phi3: tensor_parallel_size > 1 is not supported"):
        LLM(str(checkpoints("default")), progress=False, tensor_parallel_size=2)


def test_weight_shapes_are_the_fused_tensors_transformers_saves(checkpoints):
    from safetensors import safe_open

    directory = checkpoints("default")
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    config = hf_model_config(directory)
    assert PHI3.weight_shapes(config) == saved
    linear = PHI3.linear_weights(config)
    assert "model.layers.0.self_attn.qkv_proj.weight" in linear and "model.layers.1.mlp.gate_up_proj.weight" in linear
    assert not any("norm" in name for name in linear)


def test_int8_weights_load_shard_by_shard_and_stay_close(checkpoints):
    path = checkpoints("default")
    exact = LLM(str(path), progress=False).engine.score(PROMPT)
    quantized = LLM(str(path), progress=False, quantization="int8").engine.score(PROMPT)
    assert (quantized - exact).abs().max() < 0.05
