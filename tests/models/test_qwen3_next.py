"""Qwen3-Next through the engine against transformers (float32, tests/utils.py's tiny checkpoint: Qwen3.5-MoE's but
for the fused in_proj_qkvz / in_proj_ba and a dense MLP on layer 2): the shared parity suite, chunks cut anywhere,
prefix-cache hits under preemption; raw top-k weights with every other layer sparse; the fused projections'
regrouping against transformers' own, the config, a checkpoint already split (as llmpipe writes one) and the config
llmpipe writes. (Its GGUF: tests/loader/test_gguf_hybrid_moe.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmpipe import LLM
from llmpipe.loader import load_checkpoint
from llmpipe.loader.hf_config import hf_config_dict, hf_model_config
from llmpipe.models.qwen3_next import QWEN3_NEXT
from llmpipe.models.qwen3_next.weights import SplitProjectionWeights
from llmpipe.models.registry import family_of
from tests.models.hybrid_suite import *  # noqa: F403  (the hybrids' shared tests)
from tests.models.parity_suite import *  # noqa: F403  (the shared parity tests)
from tests.models.parity_suite import PROMPT
from tests.utils import (QWEN35_HYBRID, TINY_HYBRID_MOE, assert_prefill_matches, build_checkpoint, reference_case)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3_next")


@pytest.fixture(scope="module")
def case(checkpoint):
    return reference_case(checkpoint)


def test_raw_top_k_weights_and_a_sparse_step_match_transformers(tmp_path):
    """norm_topk_prob false, decoder_sparse_step 2: layer 1 alone has experts."""
    path = build_checkpoint("Qwen3NextConfig", {**QWEN35_HYBRID, **TINY_HYBRID_MOE, "norm_topk_prob": False,
                                                "decoder_sparse_step": 2}, tmp_path)
    _, reference, llm = reference_case(path)
    moe = llm.engine.config.model_config.extra.moe
    assert not moe.norm_topk_prob and moe.sparse_layers == (False, True, False)
    assert_prefill_matches(llm, reference, PROMPT)


def test_config_reads_the_experts_and_the_dense_layer(checkpoint):
    config = hf_model_config(checkpoint)
    assert family_of(config.architecture) is QWEN3_NEXT and not config.extra.v_heads_tiled
    moe = config.extra.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.shared_expert_intermediate_size, moe.norm_topk_prob) == (8, 2, 80, True)
    assert moe.sparse_layers == (True, True, False) and config.intermediate_size == 112  # the dense layer's width


@torch.no_grad()
def test_the_regrouped_projections_are_transformers_q_k_v_z_b_a(case):
    """in_proj_qkv / z / b / a read from the fused tensors give, on any input, the q, k, v, z, b, a transformers'
    fix_query_key_value_ordering derives from in_proj_qkvz and in_proj_ba."""
    path, reference, _ = case
    checkpoint = load_checkpoint(str(path))
    assert isinstance(checkpoint.source, SplitProjectionWeights)
    mixer = reference.model.layers[0].linear_attn
    x = torch.randn(1, 5, reference.config.hidden_size)
    q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(x), mixer.in_proj_ba(x))
    read = checkpoint.source.read
    ours = {part: x @ read(f"model.layers.0.linear_attn.in_proj_{part}.weight").T for part in ("qkv", "z", "b", "a")}
    torch.testing.assert_close(ours["qkv"], torch.cat([t.flatten(2) for t in (q, k, v)], -1), atol=1e-6, rtol=0)
    for part, theirs in (("z", z.flatten(2)), ("b", b), ("a", a)):
        torch.testing.assert_close(ours[part], theirs, atol=1e-6, rtol=0)


def test_a_checkpoint_already_split_loads_as_it_is(case, tmp_path):
    """What `llmpipe quantize` writes: the tensors under the names the model loads, its own config.json."""
    path, reference, _ = case
    checkpoint = load_checkpoint(str(path))
    save_file(dict(checkpoint.iter_weights()), tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(checkpoint.config)))
    split = LLM(str(tmp_path), progress=False)
    assert split.engine.config.model_config == checkpoint.config
    assert_prefill_matches(split, reference, PROMPT)


def test_the_config_llmpipe_writes_reads_back(checkpoint, tmp_path):
    config = hf_model_config(checkpoint)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(config)))
    assert hf_model_config(tmp_path) == config
