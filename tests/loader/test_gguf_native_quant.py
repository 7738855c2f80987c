"""GGUF Q4_0 / Q4_1 / Q4_K / Q5_0 / Q3_K / Q6_K / Q8_0 / IQ4_NL / IQ4_XS weights kept quantized: ggml's weights
exactly, and the same model as the dequantized float one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from llmpipe import LLM, SamplingParams
from llmpipe.loader.gguf_weights import NATIVE_FORMATS, native_weight
from llmpipe.quant.formats import Int4Weight, Int8Weight, Q5_0Weight
from llmpipe.quant.linear import Int4Linear, Int8Linear, Q5_0Linear
from tests.loader.gguf_helpers import wide_llama, write_gguf
from tests.loader.test_gguf_quants import RANDOM_BLOCK_SCALE_OFFSETS, random_blocks, random_weights
from tests.models.test_llama_parity import PROMPT

QTYPES = {
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_1,
    "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
    "model.layers.0.self_attn.v_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.gate_proj.weight": Q.Q4_0,
    "model.layers.0.mlp.up_proj.weight": Q.Q4_0,
    "model.layers.0.self_attn.o_proj.weight": Q.Q5_0,
    "model.layers.1.self_attn.q_proj.weight": Q.Q4_1,  # k and v float: the stacked qkv stays float
    "model.layers.1.self_attn.o_proj.weight": Q.Q8_0,
    "model.layers.1.mlp.gate_proj.weight": Q.Q5_0,  # with a Q8_0 up: the stacked gate_up holds both as int8
    "model.layers.1.mlp.up_proj.weight": Q.Q8_0,
    "lm_head.weight": Q.Q8_0,
}


@pytest.mark.parametrize("qtype", list(NATIVE_FORMATS), ids=lambda q: q.name)
def test_a_native_weight_dequantizes_to_ggmls_weights_bit_for_bit(qtype):
    raw = random_blocks(qtype) if qtype in RANDOM_BLOCK_SCALE_OFFSETS else quants.quantize(random_weights(), qtype)
    weight = native_weight(qtype, torch.from_numpy(raw))
    kind, group = NATIVE_FORMATS[qtype]
    assert isinstance(weight, {"int4": Int4Weight, "int8": Int8Weight, "q5_0": Q5_0Weight}[kind])
    assert weight.group_size == group
    expected = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(weight.dequantize(), expected)


def test_q4_and_q8_tensors_stay_quantized_and_compute_the_dequantized_model(tiny_gguf):
    path = str(tiny_gguf("llama_gqa", QTYPES))
    native, dense = LLM(path, activation_quantization=None, progress=False), LLM(path, dtype="float32", progress=False)
    layers = native.engine.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, Int4Linear) and layers[0].self_attn.qkv_proj.group_size == 32
    assert isinstance(layers[0].mlp.gate_up_proj, Int4Linear)
    assert isinstance(layers[0].self_attn.o_proj, Q5_0Linear)  # the file's blocks
    assert isinstance(layers[1].self_attn.o_proj, Int8Linear) and layers[1].self_attn.o_proj.group_size == 32
    assert isinstance(native.engine.model.lm_head, Int8Linear)
    assert isinstance(layers[1].mlp.gate_up_proj, Int8Linear) and layers[1].mlp.gate_up_proj.group_size == 32
    assert not isinstance(layers[1].mlp.down_proj, (Int4Linear, Int8Linear))  # float in the file: stays float
    assert not isinstance(layers[1].self_attn.qkv_proj, (Int4Linear, Int8Linear))  # mixed formats
    assert native.engine.weight_bytes < dense.engine.weight_bytes
    torch.testing.assert_close(native.engine.score(PROMPT), dense.engine.score(PROMPT), atol=1e-4, rtol=0)
    torch.testing.assert_close(native.engine.score(PROMPT[:5]), dense.engine.score(PROMPT[:5]), atol=1e-4, rtol=0)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [{"prompt_token_ids": PROMPT}]
    assert native.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        dense.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_an_explicit_float_dtype_dequantizes(tiny_gguf):
    llm = LLM(str(tiny_gguf("llama_gqa", QTYPES)), dtype="float32", progress=False)
    assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in llm.engine.model.modules())


@pytest.mark.slow
def test_smollm2_runs_q4_1_in_fewer_bytes_than_its_file(smollm2_gguf):
    llm = LLM("smollm2-135m-instruct", progress=False)
    assert isinstance(llm.engine.model.model.layers[0].mlp.gate_up_proj, Int4Linear)
    assert llm.engine.weight_bytes < 1.3 * smollm2_gguf.stat().st_size  # float32 would be ~5x the file


@pytest.mark.slow
def test_smollm2_int4_greedy_matches_dequantized_float32_up_to_a_near_tie():
    """The demo prompt: greedy tokens of the Q4_1-kept model equal the dequantized float32 model's,
    up to the first step where the float run's top-2 logit margin is below 0.01."""
    chat = [{"role": "user", "content": "How does inference work?"}]
    params = SamplingParams(temperature=0.0, max_tokens=96)
    dense = LLM("smollm2-135m-instruct", dtype="float32", progress=False)
    float_out = dense.chat(chat, params)[0]
    prompt, ref = float_out.prompt_token_ids, float_out.outputs[0].token_ids
    logits = dense.engine.score(prompt + ref)[len(prompt) - 1 : len(prompt) - 1 + len(ref)]
    top2 = logits.topk(2, dim=-1).values
    near_tie = next((i for i, m in enumerate((top2[:, 0] - top2[:, 1]).tolist()) if m < 0.01), len(ref))
    ours = LLM("smollm2-135m-instruct", progress=False).chat(chat, params)[0].outputs[0].token_ids
    assert ours[:near_tie] == ref[:near_tie]


# Layer 0's attention and gate_up Q5_0 (its down_proj's 112 inputs are no whole blocks); layer 1's gate_up
# mixes Q5_0 with Q8_0 (held as int8), its o_proj Q5_0.
Q5_0_QTYPES = {
    **{f"model.layers.0.{name}.weight": Q.Q5_0 for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj")},
    "model.layers.1.mlp.gate_proj.weight": Q.Q5_0,
    "model.layers.1.mlp.up_proj.weight": Q.Q8_0,
    "model.layers.1.self_attn.o_proj.weight": Q.Q5_0,
    "lm_head.weight": Q.Q8_0,
}


@pytest.mark.parametrize("activations", [None, "auto"], ids=["float activations", "default"])
def test_q5_0_blocks_decode_what_their_int8_codes_decode(tiny_gguf, monkeypatch, activations):
    """Q5_0 kept as the file's blocks and the same tensors held as int8 codes: the same tokens and logprobs,
    bit for bit, for a batch of prompts, through the fused decode step and layer by layer."""
    path = str(tiny_gguf("llama_gqa", Q5_0_QTYPES))
    blocks = LLM(path, activation_quantization=activations, progress=False)
    monkeypatch.setitem(NATIVE_FORMATS, Q.Q5_0, ("int8", 32))
    codes = LLM(path, activation_quantization=activations, progress=False)
    layer = blocks.engine.model.model.layers[0]
    assert all(isinstance(m, Q5_0Linear) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj))
    assert isinstance(codes.engine.model.model.layers[0].mlp.gate_up_proj, Int8Linear)
    assert blocks.engine.weight_bytes < codes.engine.weight_bytes
    assert blocks.engine.model.model.decode_step() is not None  # the fused step takes Q5_0 layers
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": PROMPT[:n]} for n in (len(PROMPT), 3, 9)]
    for fused, batch in ((True, prompts), (True, prompts[:1]), (False, prompts)):
        for llm in (blocks, codes):
            llm.engine.model.model.fused_decode = fused
        ours, theirs = (llm.generate(batch, params, use_tqdm=False) for llm in (blocks, codes))
        for a, b in zip(ours, theirs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert [{t: p.logprob for t, p in step.items()} for step in a.outputs[0].logprobs] == \
                [{t: p.logprob for t, p in step.items()} for step in b.outputs[0].logprobs]


# The types of Q3_K_M / Q2_K / IQ4_XS / IQ4_NL / Q5_1 files, in a model whose rows are whole super-blocks: random
# blocks with float16 scales that give weights about the float model's size (Q5_1 quantizes the model's own).
RANDOM_BLOCK_SCALES = {Q.Q2_K: 0.003, Q.Q3_K: 0.002, Q.IQ4_NL: 0.001, Q.IQ4_XS: 6e-5}
WIDE_QTYPES = {
    **{f"blk.0.attn_{x}.weight": Q.Q3_K for x in "qkv"},  # int8, groups of 16
    "blk.0.attn_output.weight": Q.IQ4_XS,
    "blk.0.ffn_gate.weight": Q.IQ4_NL,
    "blk.0.ffn_up.weight": Q.IQ4_NL,
    "blk.0.ffn_down.weight": Q.Q2_K,  # dequantized
    **{f"blk.1.attn_{x}.weight": Q.Q5_1 for x in "qkv"},  # dequantized
    "blk.1.attn_output.weight": Q.Q3_K,
    "blk.1.ffn_gate.weight": Q.IQ4_XS,  # with an IQ4_NL up: both int8 groups of 32, one layer
    "blk.1.ffn_up.weight": Q.IQ4_NL,
    "blk.1.ffn_down.weight": Q.IQ4_XS,
    "output.weight": Q.Q3_K,
}


def write_wide_llama(tmp_path: Path) -> tuple[Path, Path]:
    """A GGUF with WIDE_QTYPES' tensors as raw blocks, and its float twin: those tensors as gguf.quants
    dequantizes them."""
    metadata, tensors = wide_llama()
    floats = dict(tensors)
    for seed, (name, qtype) in enumerate(WIDE_QTYPES.items()):
        weight = tensors[name]
        raw = (quants.quantize(weight, qtype) if qtype == Q.Q5_1
               else random_blocks(qtype, seed, weight.shape, RANDOM_BLOCK_SCALES[qtype]))
        tensors[name] = (raw, qtype)
        floats[name] = quants.dequantize(raw, qtype).astype(np.float32)
    return (write_gguf(tmp_path / "quantized.gguf", "llama", metadata, tensors),
            write_gguf(tmp_path / "float.gguf", "llama", metadata, floats))


def test_q3_k_and_iq4_stay_quantized_q2_k_and_q5_1_dequantize_and_all_compute_the_float_model(tmp_path):
    quantized, floats = write_wide_llama(tmp_path)
    native = LLM(str(quantized), activation_quantization=None, progress=False)
    dense = LLM(str(floats), dtype="float32", progress=False)
    layers = native.engine.model.model.layers
    int8_groups = {"0.qkv": (layers[0].self_attn.qkv_proj, 16), "0.o": (layers[0].self_attn.o_proj, 32),
                   "0.gate_up": (layers[0].mlp.gate_up_proj, 32), "1.o": (layers[1].self_attn.o_proj, 16),
                   "1.gate_up": (layers[1].mlp.gate_up_proj, 32), "1.down": (layers[1].mlp.down_proj, 32),
                   "head": (native.engine.model.lm_head, 16)}
    for where, (module, group) in int8_groups.items():
        assert isinstance(module, Int8Linear) and module.group_size == group, where
    assert not isinstance(layers[0].mlp.down_proj, (Int4Linear, Int8Linear))  # Q2_K
    assert not isinstance(layers[1].self_attn.qkv_proj, (Int4Linear, Int8Linear))  # Q5_1
    assert native.engine.weight_bytes < dense.engine.weight_bytes
    torch.testing.assert_close(native.engine.score(PROMPT), dense.engine.score(PROMPT), atol=1e-4, rtol=0)
    dequantized = LLM(str(quantized), dtype="float32", progress=False)  # llmpipe's dequantizers: the same weights
    assert torch.equal(dequantized.engine.score(PROMPT), dense.engine.score(PROMPT))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [{"prompt_token_ids": PROMPT}]
    tokens = [llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
              for llm in (native, dense, LLM(str(quantized), progress=False))]  # the last: default activations
    assert tokens[0] == tokens[1] == tokens[2]
