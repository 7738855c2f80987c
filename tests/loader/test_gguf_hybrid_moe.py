"""GGUF `qwen35moe` and `qwen3next` as llama.cpp's converter writes them (test_gguf_qwen35.py's conversion, experts
merged into 3-D tensors): Qwen3.5-MoE's value heads tiled, its multi-token-prediction block appended and not run;
Qwen3-Next's value heads in Hugging Face's order, its fused qkvz split into attn_qkv / attn_gate (or, in files
converted before llama.cpp split it, kept as ssm_in) and its ba kept as ssm_ba, regrouped at load. Float, each is
transformers' model; Q8_0, the regrouped rows stay the file's blocks and compute their dequantized values."""

from __future__ import annotations

import gguf
import pytest
import torch

from llmpipe import LLM
from llmpipe.quant.linear import GGMLLinear
from tests.loader.gguf_helpers import write_gguf
from tests.loader.test_gguf_qwen35 import converter_metadata, converter_tensors
from tests.models.parity_suite import GREEDY, PROMPT
from tests.utils import QWEN35_HYBRID, TINY_HYBRID_MOE, build_checkpoint, reference_greedy, split_fused_projections


def load(path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen3_5_moe(tiny_checkpoint):
    return load(tiny_checkpoint("qwen3_5_moe"))


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """Every layer sparse: llama.cpp's qwen3next has no dense MLP tensors."""
    return load(build_checkpoint("Qwen3NextConfig", {**QWEN35_HYBRID, **TINY_HYBRID_MOE}, tmp_path_factory.mktemp("next")))


def with_mtp_block(metadata: dict, tensors: dict, arch: str, layers: int) -> tuple[dict, dict]:
    """A multi-token-prediction block after the last layer, as the converter appends it (block_count counts it)."""
    extra = {f"blk.{layers}.attn_norm.weight": tensors["output_norm.weight"],
             f"blk.{layers}.nextn.eh_proj.weight": tensors["blk.1.attn_output.weight"]}
    recurrent = metadata[f"{arch}.attention.recurrent_layers"] + [False]
    return metadata | {f"{arch}.block_count": layers + 1, f"{arch}.nextn_predict_layers": 1,
                       f"{arch}.attention.recurrent_layers": recurrent}, tensors | extra


def assert_is_transformers_model(path, reference) -> LLM:
    llm = LLM(str(path), progress=False, activation_quantization=None)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(llm.engine.score(PROMPT), theirs, atol=1e-4, rtol=0)
    assert llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids == reference_greedy(reference, PROMPT)[0]
    return llm


def test_a_qwen35moe_gguf_is_transformers_model(qwen3_5_moe, tmp_path):
    """No feed_forward_length (Qwen's configs have no intermediate_size to write), and an MTP block beside."""
    metadata = converter_metadata(qwen3_5_moe.config, "qwen35moe")
    del metadata["qwen35moe.feed_forward_length"]  # the tiny config carries TINY_COMMON's
    tensors = converter_tensors(qwen3_5_moe, False, gguf.MODEL_ARCH.QWEN35MOE)
    path = write_gguf(tmp_path / "qwen35moe.gguf", "qwen35moe", *with_mtp_block(metadata, tensors, "qwen35moe", 3))
    llm = assert_is_transformers_model(path, qwen3_5_moe)
    config = llm.engine.config.model_config
    assert config.num_hidden_layers == 3 and config.extra.v_heads_tiled and config.extra.moe.num_experts == 8


@pytest.mark.parametrize("legacy", [False, True])
def test_a_qwen3next_gguf_is_transformers_model(qwen3_next, tmp_path, legacy):
    """legacy: the fused in_proj_qkvz as ssm_in, regrouped at load as ssm_ba is."""
    state = split_fused_projections(qwen3_next.state_dict(), qwen3_next.config, () if legacy else ("qkvz",))
    tensors = converter_tensors(qwen3_next, False, gguf.MODEL_ARCH.QWEN3NEXT, state)
    assert ("blk.0.ssm_in.weight" in tensors) is legacy and "blk.0.ssm_ba.weight" in tensors
    path = write_gguf(tmp_path / "qwen3next.gguf", "qwen3next", converter_metadata(qwen3_next.config, "qwen3next"), tensors)
    llm = assert_is_transformers_model(path, qwen3_next)
    assert not llm.engine.model.model.layers[0].linear_attn.tiled


def test_q8_0_fused_projections_are_regrouped_as_blocks(qwen3_next, tmp_path):
    """A Q8_0 ssm_in and ssm_ba: the linear layers' stacked projection holds their regrouped block rows, and computes
    what a float file of gguf-py's dequantization of the same blocks does."""
    quantized = converter_tensors(qwen3_next, True, gguf.MODEL_ARCH.QWEN3NEXT, qwen3_next.state_dict())
    dequantized = {name: gguf.quants.dequantize(gguf.quants.quantize(t[0], t[1]), t[1]) if isinstance(t, tuple) else t
                   for name, t in quantized.items()}
    metadata = converter_metadata(qwen3_next.config, "qwen3next")
    q8, exact = (LLM(str(write_gguf(tmp_path / f"{name}.gguf", "qwen3next", metadata, tensors)), progress=False,
                     activation_quantization=None) for name, tensors in (("q8", quantized), ("f32", dequantized)))
    assert isinstance(q8.engine.model.model.layers[0].linear_attn.in_proj, GGMLLinear)
    torch.testing.assert_close(q8.engine.score(PROMPT), exact.engine.score(PROMPT), atol=1e-4, rtol=0)
