"""A qwen3moe / qwen2moe GGUF (each layer's experts as 3-D tensors, as llama.cpp's converter writes them): float,
it is transformers' model; quantized, each expert is its own slice of the file's blocks, read in place, and computes
the dequantized model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmpipe import LLM
from llmpipe.quant.linear import GGMLLinear, stacked_linear
from tests.loader.test_gguf_native_quant import mapped_file
from tests.models.test_llama_decode_step import PROMPTS, assert_matches_layered
from tests.models.test_qwen3_moe import GREEDY, PROMPT

EXPERT_QTYPES = {  # quantized 3-D experts (layer 1's down in gpt-oss's MXFP4; a quantized attention), the rest float
    **{f"model.layers.{i}.mlp.experts.{w}_proj.weight": q for i, down in ((0, Q.Q4_0), (1, Q.MXFP4))
       for w, q in (("gate", Q.Q8_0), ("up", Q.Q8_0), ("down", down))},
    "model.layers.0.self_attn.o_proj.weight": Q.Q8_0,
}


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_a_float_gguf_matches_transformers(tiny_gguf, transformers_model, name):
    """qwen3moe, and qwen2moe with its gated shared expert (ffn_*_shexp) and raw top-k weights."""
    llm = LLM(str(tiny_gguf(name)), progress=False)
    with torch.no_grad():
        theirs = transformers_model(name)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(llm.engine.score(PROMPT), theirs, atol=1e-4, rtol=0)


def test_quantized_experts_are_read_in_place_and_compute_the_dequantized_model(tiny_gguf):
    path = str(tiny_gguf("qwen3_moe", EXPERT_QTYPES))
    native, dense = LLM(path, activation_quantization=None, progress=False), LLM(path, dtype="float32", progress=False)
    experts = native.engine.model.model.layers[0].mlp.experts
    assert all(isinstance(e.gate_up_proj, GGMLLinear) and isinstance(e.down_proj, GGMLLinear) for e in experts)
    if Path("/proc/self/maps").exists():  # the file's own pages: each expert's slice of the 3-D tensor
        down = [blocks for e in experts for _, blocks in e.down_proj.segment_blocks()]
        assert {mapped_file(b.data_ptr()) for b in down} == {Path(path).resolve()}
        assert [b.data_ptr() - down[0].data_ptr() for b in down] == [e * down[0].numel() for e in range(len(down))]
    assert native.engine.weight_bytes < dense.engine.weight_bytes
    torch.testing.assert_close(native.engine.score(PROMPT), dense.engine.score(PROMPT), atol=1e-4, rtol=0)
    outputs = [llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids for llm in (native, dense)]
    assert outputs[0] == outputs[1]


def test_a_tokens_experts_in_one_kernel_call_equal_each_alone(tiny_gguf):
    """stacked_linear over GGUF block weights: one call, the activation quantized once, the same numbers."""
    llm = LLM(str(tiny_gguf("qwen3_moe", EXPERT_QTYPES)), progress=False)
    experts = llm.engine.model.model.layers[0].mlp.experts
    layers = [experts[e].gate_up_proj for e in (5, 0, 3)]
    x = torch.randn(1, layers[0].in_features)
    assert torch.equal(stacked_linear(x, layers), torch.cat([m(x) for m in layers], dim=-1))


def test_the_fused_decode_step_runs_quantized_experts_as_layer_by_layer(tiny_gguf):
    """GGUF experts (Q8_0 gate / up, Q4_0 and MXFP4 down) with 16-bit activation blocks in the whole-stack step: as
    the layered path to quantization noise (the step's norm and SiLU round differently in the last bit),
    the same greedy tokens up to a near tie."""
    llm = LLM(str(tiny_gguf("qwen3_moe", EXPERT_QTYPES)), progress=False)
    assert llm.engine.model.model.decode_step() is not None
    assert_matches_layered(llm, atol=0.05, prompts=PROMPTS[:1], near_tie=0.2)
    assert_matches_layered(llm, atol=0.05, prompts=PROMPTS, near_tie=0.2)  # a batch: experts shared by rows
