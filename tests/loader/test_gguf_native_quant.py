"""GGUF weights kept quantized as the file's own blocks (GGMLLinear): ggml's weights exactly, and the same model as
the dequantized float one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from llmpipe import LLM, SamplingParams
from llmpipe.loader import load_checkpoint
from llmpipe.loader.gguf_weights import NATIVE_FORMATS, native_weight
from llmpipe.quant.formats import GGMLWeight
from llmpipe.quant.linear import GGMLLinear, QuantizedLinear
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
    "model.layers.1.mlp.gate_proj.weight": Q.Q5_0,  # with a Q8_0 up: one layer, two segments of blocks
    "model.layers.1.mlp.up_proj.weight": Q.Q8_0,
    "lm_head.weight": Q.Q8_0,
}


@pytest.mark.parametrize("qtype", list(NATIVE_FORMATS), ids=lambda q: q.name)
def test_a_native_weight_dequantizes_to_ggmls_weights_bit_for_bit(qtype):
    raw = random_blocks(qtype) if qtype in RANDOM_BLOCK_SCALE_OFFSETS else quants.quantize(random_weights(), qtype)
    rows = torch.from_numpy(raw)
    weight = native_weight(qtype, rows)
    assert isinstance(weight, GGMLWeight) and weight.ggml_type == qtype
    assert weight.blocks.data_ptr() == rows.data_ptr()  # the file's bytes, not a copy
    expected = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(weight.dequantize(), expected)


def mapped_file(address: int) -> Path | None:
    """The file whose mapping holds `address` (None: anonymous memory), from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(v, 16) for v in fields[0].split("-"))
        if low <= address < high:
            return Path(fields[5]) if len(fields) > 5 and fields[5].startswith("/") else None
    return None


def test_q4_and_q8_tensors_stay_quantized_and_compute_the_dequantized_model(tiny_gguf):
    path = str(tiny_gguf("llama_gqa", QTYPES))
    native, dense = LLM(path, activation_quantization=None, progress=False), LLM(path, dtype="float32", progress=False)
    layers = native.engine.model.model.layers
    for module, shards in ((layers[0].self_attn.qkv_proj, 3), (layers[0].mlp.gate_up_proj, 2), (layers[0].self_attn.o_proj, 1),
                           (layers[1].self_attn.o_proj, 1), (native.engine.model.lm_head, 1)):
        assert isinstance(module, GGMLLinear) and len(module.segments) == shards  # a segment per tensor of the file
    assert [t for t, _, _ in layers[1].mlp.gate_up_proj.segments] == [Q.Q5_0, Q.Q8_0]
    assert not isinstance(layers[1].mlp.down_proj, QuantizedLinear)  # float in the file: stays float
    assert not isinstance(layers[1].self_attn.qkv_proj, QuantizedLinear)  # Q4_1 q with float k, v
    file = {t.name: t for t in load_checkpoint(path).source._reader.tensors}
    gate_up = [b for _, b in layers[0].mlp.gate_up_proj.segment_blocks()]
    assert [b.numel() for b in gate_up] == [file[f"blk.0.ffn_{n}.weight"].n_bytes for n in ("gate", "up")]
    assert [b.numpy().tobytes() for b in gate_up] == [file[f"blk.0.ffn_{n}.weight"].data.tobytes() for n in ("gate", "up")]
    if Path("/proc/self/maps").exists():  # v and o are the file's pages (q and k: rows unpermuted, copies)
        qkv, o = layers[0].self_attn.qkv_proj.segment_blocks(), layers[0].self_attn.o_proj.segment_blocks()
        assert [mapped_file(b.data_ptr()) for _, b in (*qkv, *o)] == [None, None, Path(path).resolve(), Path(path).resolve()]
    assert native.engine.weight_bytes < dense.engine.weight_bytes
    torch.testing.assert_close(native.engine.score(PROMPT), dense.engine.score(PROMPT), atol=1e-4, rtol=0)
    torch.testing.assert_close(native.engine.score(PROMPT[:5]), dense.engine.score(PROMPT[:5]), atol=1e-4, rtol=0)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [{"prompt_token_ids": PROMPT}]
    tokens = [llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
              for llm in (native, dense, LLM(path, progress=False))]  # the last: integer-dot activations
    assert tokens[0] == tokens[1] == tokens[2]


def test_an_explicit_float_dtype_dequantizes(tiny_gguf):
    llm = LLM(str(tiny_gguf("llama_gqa", QTYPES)), dtype="float32", progress=False)
    assert not any(isinstance(m, QuantizedLinear) for m in llm.engine.model.modules())


@pytest.mark.slow
def test_smollm2_runs_q4_1_in_its_files_bytes(smollm2_gguf):
    llm = LLM("smollm2-135m-instruct", progress=False)
    assert isinstance(llm.engine.model.model.layers[0].mlp.gate_up_proj, GGMLLinear)
    assert llm.engine.weight_bytes < 1.01 * smollm2_gguf.stat().st_size  # float32 would be ~5x the file


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


# Every GGML type in one model, stacked layers mixing types (rows whole super-blocks: wide_llama's).
MIXED_QTYPES = {
    **{f"blk.0.attn_{x}.weight": t for x, t in zip("qkv", (Q.Q4_K, Q.BF16, Q.Q6_K))},  # k: rows unpermuted, floats
    "blk.0.attn_output.weight": Q.Q5_K,
    "blk.0.ffn_gate.weight": Q.IQ4_XS,
    "blk.0.ffn_up.weight": Q.Q8_0,
    "blk.0.ffn_down.weight": Q.F16,
    **{f"blk.1.attn_{x}.weight": t for x, t in zip("qkv", (Q.Q4_0, Q.Q4_1, Q.Q5_0))},
    "blk.1.attn_output.weight": Q.Q5_1,
    "blk.1.ffn_gate.weight": Q.IQ4_NL,
    "blk.1.ffn_up.weight": Q.MXFP4,  # gpt-oss's experts' type, quantized by gguf-py
    "blk.1.ffn_down.weight": Q.Q2_K,
    "output.weight": Q.Q3_K,
}
RANDOM_SCALES = {Q.Q2_K: 0.003, Q.Q3_K: 0.002, Q.Q4_K: 0.002, Q.Q5_K: 0.001, Q.Q6_K: 0.0001, Q.IQ4_XS: 6e-5, Q.IQ4_NL: 0.001}


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_the_fused_decode_step_gives_the_layers_tokens_and_logprobs(tmp_path, activations):
    """GGML layers of every type, mixed in stacked layers, through the one-call decode step and layer by layer:
    the same tokens and logprobs for a batch of prompts and for one (up to rounding: the fused step's activation
    and norms are within float32 ulps of PyTorch's); and the greedy tokens of the float model."""
    metadata, tensors = wide_llama()
    floats = dict(tensors)
    for seed, (name, qtype) in enumerate(MIXED_QTYPES.items()):
        weight = tensors[name]
        raw = (random_blocks(qtype, seed, weight.shape, RANDOM_SCALES[qtype]) if qtype in RANDOM_SCALES
               else quants.quantize(weight, qtype))
        tensors[name] = (raw, qtype)
        floats[name] = quants.dequantize(raw, qtype).astype(np.float32)
    path = write_gguf(tmp_path / "mixed.gguf", "llama", metadata, tensors)
    llms = {fused: LLM(str(path), activation_quantization=activations, progress=False) for fused in (True, False)}
    llm = llms[True]
    layers = llm.engine.model.model.layers
    assert [t for t, _, _ in layers[0].self_attn.qkv_proj.segments] == [Q.Q4_K, Q.BF16, Q.Q6_K]
    assert [t for t, _, _ in layers[1].self_attn.qkv_proj.segments] == [Q.Q4_0, Q.Q4_1, Q.Q5_0]
    assert all(isinstance(m, GGMLLinear) for layer in layers for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert llm.engine.model.model.decode_step() is not None  # the fused step takes GGML layers
    llms[False].engine.model.model.fused_decode = False
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": PROMPT[:n]} for n in (len(PROMPT), 3, 9)]
    # A batch the AMX tiles take, where present. 15-bit blocks only: at 8 bits, the fused step's norms (float32 ulps
    # from PyTorch's) move a code across a rounding tie here and there, by up to 0.05 in a logprob, on any ISA.
    many = [{"prompt_token_ids": PROMPT[: 2 + i]} for i in range(10)] if activations == "int16" else []
    tolerance = 3e-3 if activations == "int16" else 0.05
    for batch in (prompts, prompts[:1], many):  # the same runs in the same order: the prefix cache hits alike
        ours, theirs = (llms[fused].generate(batch, params, use_tqdm=False) for fused in (True, False))
        for a, b in zip(ours, theirs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert x.keys() == y.keys()
                # random blocks make a model that amplifies rounding: its float-activation and 15-bit runs
                # differ by ~1e-3 as well (8-bit codes crossing a tie: ~0.02); a wrong block would move logprobs
                # by whole units
                assert all(abs(x[t].logprob - y[t].logprob) < tolerance for t in x), [(x[t].logprob, y[t].logprob) for t in x]
    if activations == "int16":  # 15-bit activation blocks: the float model's function to float32 rounding
        dense = LLM(str(write_gguf(tmp_path / "float.gguf", "llama", metadata, floats)), dtype="float32", progress=False)
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        for batch in (prompts, many):
            assert [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)] == \
                [o.outputs[0].token_ids for o in dense.generate(batch, greedy, use_tqdm=False)]


# The types of Q3_K_M / Q2_K / IQ4_XS / IQ4_NL / Q5_1 files, in a model whose rows are whole super-blocks: random
# blocks with float16 scales that give weights about the float model's size (Q5_1 quantizes the model's own).
RANDOM_BLOCK_SCALES = {Q.Q2_K: 0.003, Q.Q3_K: 0.002, Q.IQ4_NL: 0.001, Q.IQ4_XS: 6e-5}
WIDE_QTYPES = {
    **{f"blk.0.attn_{x}.weight": Q.Q3_K for x in "qkv"},
    "blk.0.attn_output.weight": Q.IQ4_XS,
    "blk.0.ffn_gate.weight": Q.IQ4_NL,
    "blk.0.ffn_up.weight": Q.Q2_K,  # with an IQ4_NL gate: one layer, two segments
    "blk.0.ffn_down.weight": Q.Q2_K,
    **{f"blk.1.attn_{x}.weight": Q.Q5_1 for x in "qkv"},
    "blk.1.attn_output.weight": Q.Q3_K,
    "blk.1.ffn_gate.weight": Q.IQ4_XS,  # with an IQ4_NL up: one layer, two segments
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


def test_q2_k_q3_k_and_iq4_stay_quantized_and_compute_the_float_model(tmp_path):
    quantized, floats = write_wide_llama(tmp_path)
    native = LLM(str(quantized), activation_quantization=None, progress=False)
    dense = LLM(str(floats), dtype="float32", progress=False)
    layers = native.engine.model.model.layers
    for layer in layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(module, GGMLLinear)
    assert isinstance(native.engine.model.lm_head, GGMLLinear)
    assert [t for t, _, _ in layers[0].mlp.gate_up_proj.segments] == [Q.IQ4_NL, Q.Q2_K]
    file_bytes = {t.name: int(t.n_bytes) for t in load_checkpoint(str(quantized)).source._reader.tensors}
    assert sum(b.numel() for _, b in layers[0].self_attn.qkv_proj.segment_blocks()) == sum(
        file_bytes[f"blk.0.attn_{x}.weight"] for x in "qkv")  # Q3_K in the file's bytes
    assert native.engine.weight_bytes < dense.engine.weight_bytes
    torch.testing.assert_close(native.engine.score(PROMPT), dense.engine.score(PROMPT), atol=1e-4, rtol=0)
    dequantized = LLM(str(quantized), dtype="float32", progress=False)  # llmpipe's dequantizers: the same weights
    assert torch.equal(dequantized.engine.score(PROMPT), dense.engine.score(PROMPT))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [{"prompt_token_ids": PROMPT}]
    tokens = [llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
              for llm in (native, dense, LLM(str(quantized), progress=False))]  # the last: default activations
    assert tokens[0] == tokens[1] == tokens[2]


def test_float_activations_take_slices_of_rows_that_miss_a_segment(monkeypatch):
    """The float path dequantizes DEQUANTIZE_ROWS rows at a time: a slice wholly inside one segment (a Q4_K_M
    qkv's Q4_K q and k, its Q6_K v) leaves the others out, as without the kernels (the portable path)."""
    from llmpipe.kernels import ops
    from llmpipe.quant.linear import DEQUANTIZE_ROWS

    sizes, types = (DEQUANTIZE_ROWS + 64, 32), (Q.Q4_K, Q.Q6_K)
    blocks = [random_blocks(t, seed=i, shape=(n, 256)) for i, (t, n) in enumerate(zip(types, sizes))]
    layer = GGMLLinear(256, sum(sizes))
    layer.shard_sizes = sizes
    for i, (t, raw) in enumerate(zip(types, blocks)):
        layer.load_shard(i, native_weight(t, torch.from_numpy(raw)))
    weight = torch.cat([torch.from_numpy(quants.dequantize(raw, t).astype(np.float32)) for t, raw in zip(types, blocks)])
    rows = torch.tensor([3, DEQUANTIZE_ROWS + 70, 5])
    assert torch.equal(layer.kernel_weight(torch.tensor([7, 2])), weight[[7, 2]])  # one segment's rows only
    assert torch.equal(layer.kernel_weight(rows), weight[rows])
    x = torch.randn(3, 256)
    monkeypatch.setattr(ops, "available", lambda: False)
    for bits in (None, 16):  # float activations, and the integer kernels' fallback without the library
        layer.activation_bits = bits
        torch.testing.assert_close(layer(x), x @ weight.T, atol=1e-4, rtol=1e-5)
