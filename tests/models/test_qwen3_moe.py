"""Qwen3-MoE against transformers on tiny random-weight checkpoints (float32): 8 experts, 3 a token, a dense
layer among the sparse ones; prefill, decode, chunked, batched, with prefix-cache hits and preemption; and
the expert dispatch against a plain per-token loop. (Its GGUF: tests/loader/test_gguf_moe.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmpipe import LLM
from llmpipe.errors import UnsupportedModelError
from llmpipe.layers.moe import dispatch
from llmpipe.loader.hf_config import hf_model_config
from llmpipe.models.qwen3_moe import QWEN3_MOE
from llmpipe.models.registry import family_of
from tests.models.parity_suite import *  # noqa: F403  (the shared parity tests)
from tests.models.parity_suite import PROMPT, assert_prefix_hits_and_preemption_keep_the_reference
from tests.models.test_families import saved_shapes
from tests.utils import (TINY_CONFIGS, build_checkpoint, reference_case)





@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def make(name: str) -> Path:
        if name not in cache:
            class_name, extra = TINY_CONFIGS["qwen3_moe"]
            cache[name] = build_checkpoint(class_name, {**extra, **VARIANTS[name]}, tmp_path_factory.mktemp(f"qwen3_moe_{name}"))
        return cache[name]

    return make


VARIANTS = {
    "renormalized": dict(mlp_only_layers=[1]),  # layer 1 of 3 keeps a dense MLP
    # raw top-k probabilities; every other layer sparse (decoder_sparse_step 2), none listed dense
    "raw-weights": dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[]),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, checkpoints):
    return reference_case(checkpoints(request.param))


def test_prefix_cache_hits_and_preemption_give_the_reference_tokens(case):
    assert_prefix_hits_and_preemption_keep_the_reference(case, max_num_blocks=9)


def test_config_reads_the_experts_and_the_dense_layers(checkpoints):
    config = hf_model_config(checkpoints("renormalized"))
    assert family_of(config.architecture) is QWEN3_MOE and config.qk_norm and config.sliding_window is None
    moe = config.extra
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == (8, 3, 64, True)
    assert moe.sparse_layers == (True, False, True)


def test_weight_shapes_are_the_per_expert_tensors_transformers_saves(checkpoints):
    directory = checkpoints("renormalized")
    config = hf_model_config(directory)
    assert QWEN3_MOE.weight_shapes(config) == saved_shapes(directory)
    linear = QWEN3_MOE.linear_weights(config)
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in linear and "model.layers.1.mlp.down_proj.weight" in linear
    assert "model.layers.0.mlp.gate.weight" not in linear  # the router stays float


def test_int8_experts_load_and_stay_close(checkpoints):
    path = checkpoints("renormalized")
    exact = LLM(str(path), progress=False).engine.score(PROMPT)
    quantized = LLM(str(path), progress=False, quantization="int8").engine.score(PROMPT)
    assert (quantized - exact).abs().max() < 0.05


def test_tensor_parallelism_is_refused(checkpoints):
    with pytest.raises(UnsupportedModelError, match="qwen3_moe: tensor_parallel_size > 1 is not supported"):
        LLM(str(checkpoints("renormalized")), progress=False, tensor_parallel_size=2)


@pytest.mark.parametrize("rows", [1, 2, 7, 40])
def test_dispatch_equals_a_per_token_loop(rows):
    torch.manual_seed(rows)
    experts = [torch.nn.Linear(16, 16) for _ in range(6)]
    x = torch.randn(rows, 16)
    indices = torch.stack([torch.randperm(6)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2)
    with torch.no_grad():
        ours = dispatch(x, weights, indices, 6, lambda part, e: experts[e](part))
        reference = torch.stack([sum(w * experts[e](x[t]) for e, w in zip(indices[t].tolist(), weights[t])) for t in range(rows)])
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=0)
