"""The integer-dot kernels (8- or 16-bit activation blocks x 4/8-bit codes) against their float64
PyTorch reference, on every code path this CPU runs (AVX2, and AVX512-VNNI where present)."""

from __future__ import annotations

import pytest
import torch

from llmpipe import LLM, SamplingParams
from llmpipe.kernels import ops
from llmpipe.quant.apply import quantize_prefill
from llmpipe.quant import linear as linear_module
from llmpipe.quant.linear import PANEL_MAX_ROWS, Int4Linear, Int8Linear, QuantizedLinear, decode_numerics

pytestmark = pytest.mark.skipif(not ops.dot_available(), reason="needs AVX2 + FMA and a C compiler")
SHAPES = [(96, 64), (50, 576), (64, 96), (33, 1536), (40, 160)]  # K = 96, 160: odd chunk counts; 576 at g128: a narrow last group


def int4_codes(layer: Int4Linear) -> torch.Tensor:
    chunks = layer.codes.view(layer.codes.shape[0], -1, ops.CHUNK // 2)
    return torch.stack([chunks & 15, chunks >> 4], dim=2).flatten(1)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("bits", ops.ACTIVATION_BITS)
@pytest.mark.parametrize("isa", ops.dot_isas(), ids=lambda i: ["avx2", "vnni"][i])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int4_dot_kernel_equals_its_reference(shape, group, isa, bits):
    out_features, in_features = shape
    torch.manual_seed(out_features + group)
    layer = Int4Linear(in_features, out_features, False, group)
    layer.load_shard(None, torch.randn(out_features, in_features))
    for rows in range(1, ops.MAX_ROWS + 1):
        x = layer.kernel_input(torch.randn(rows, in_features))
        got = ops.int4_linear_dot(x, layer.codes, layer.scale, layer.offset, group, bits, isa)
        assert_close(got, ops.reference_dot_linear(x, int4_codes(layer), layer.scale, layer.offset, group, bits))


@pytest.mark.parametrize("isa", ops.dot_isas(), ids=lambda i: ["avx2", "vnni"][i])
@pytest.mark.parametrize("bits", ops.ACTIVATION_BITS)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int4_panel_kernel_equals_its_reference(shape, group, bits, isa):
    """Any row count (tiles of four and the 1-3 left over), output rows that do not fill the last panel."""
    out_features, in_features = shape
    torch.manual_seed(out_features + group)
    layer = Int4Linear(in_features, out_features, False, group)
    layer.load_shard(None, torch.randn(out_features, in_features))
    panels = layer.batch_panels()
    assert panels.shape == (-(-out_features // ops.PANEL), layer.padded_in // ops.CHUNK, 192)
    for rows in [1, 2, 3, 4, 5, 7, 8, 13, 33]:
        x = layer.kernel_input(torch.randn(rows, in_features))
        got = ops.int4_gemm_dot(x, panels, out_features, bits, isa)
        assert_close(got, ops.reference_dot_linear(x, int4_codes(layer), layer.scale, layer.offset, group, bits))


@pytest.mark.parametrize("isa", ops.dot_isas(), ids=lambda i: ["avx2", "vnni"][i])
@pytest.mark.parametrize("bits", ops.ACTIVATION_BITS)
@pytest.mark.parametrize("group", [None, 32, 16], ids=["per-channel", "q8_0", "q6_k"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_panel_kernel_equals_its_reference(shape, group, bits, isa):
    out_features, in_features = shape
    torch.manual_seed(out_features)
    layer = Int8Linear(in_features, out_features, False, group)
    layer.q.copy_(torch.randint(-128, 128, layer.q.shape, dtype=torch.int8))  # -128 too: |w| must not overflow
    layer.scale.copy_(torch.rand(layer.scale.shape) / 100)
    panels = layer.batch_panels()
    assert panels.shape == (-(-out_features // ops.PANEL), layer.padded_in // ops.CHUNK, 320)
    for rows in [1, 2, 3, 4, 5, 7, 8, 13, 33]:
        x = layer.kernel_input(torch.randn(rows, in_features))
        got = ops.int8_gemm_dot(x, panels, out_features, bits, isa)
        assert_close(got, ops.reference_dot_linear(x, layer.q, layer.scale, None, layer.group_size, bits))


@pytest.mark.parametrize("bits", ops.ACTIVATION_BITS)
def test_the_vnni_panels_give_the_avx2_panels_results_bit_for_bit(bits):
    """The same integer dots (dpbusd / dpwssd for maddubs / madd), the same float steps after them."""
    if 1 not in ops.dot_isas():
        pytest.skip("no AVX512-VNNI on this CPU: the AVX2 panels are the only ones")
    torch.manual_seed(3)
    int4 = Int4Linear(96, 40, False, 32)
    int4.load_shard(None, torch.randn(40, 96))
    int8 = Int8Linear(96, 40, False, 16)
    int8.q.copy_(torch.randint(-128, 128, int8.q.shape, dtype=torch.int8))
    int8.scale.copy_(torch.rand(int8.scale.shape) / 100)
    for layer, op in ((int4, ops.int4_gemm_dot), (int8, ops.int8_gemm_dot)):
        x = layer.kernel_input(torch.randn(11, 96))
        avx2, vnni = (op(x, layer.batch_panels(), 40, bits, isa) for isa in (0, 1))
        assert torch.equal(avx2, vnni)


def test_int4_batches_take_the_panels_from_two_rows():
    """A batch of 2 or more rows with activation quantization goes to the panel kernel (the row kernels
    then never run), one row to the batch-1 kernels; the result is the reference's either way."""
    torch.manual_seed(0)
    layer = Int4Linear(160, 40, True, 32)
    layer.load_shard(None, torch.randn(40, 160))
    layer.bias.data.normal_()
    layer.activation_bits = 16
    row_calls = []
    layer.kernel = lambda x: row_calls.append(x.shape[0]) or Int4Linear.kernel(layer, x)
    for rows in (1, 2, 9, 32):
        x = torch.randn(rows, 160)
        assert_close(layer(x), reference_forward(layer, x, 16).double())
    assert row_calls == [1]
    pack_again = layer.panels
    layer.load_shard(None, torch.randn(40, 160))  # new weights: new panels
    assert layer.panels is None and not torch.equal(layer.batch_panels(), pack_again)


def test_in_an_engine_step_a_layer_takes_the_decode_numerics_at_any_batch_size():
    """With 16-bit blocks a linear keeps the exact GEMM past 32 rows (a scored text); inside an engine step
    (decode_numerics) it takes the integer kernels at any count, so a token's numerics are the same however
    many rows share its step."""
    torch.manual_seed(0)
    head = Int8Linear(96, 40, False, 32)
    head.q.copy_(torch.randint(-127, 128, head.q.shape, dtype=torch.int8))
    head.scale.copy_(torch.rand(head.scale.shape) / 100)
    head.activation_bits = 16
    x = torch.randn(300, 96)
    exact = x.double() @ head.kernel_weight().double().T
    decode = reference_forward(head, x, 16).double()
    for rows in (3, 40, 300):
        with decode_numerics():
            assert_close(head(x[:rows]), decode[:rows])
        with decode_numerics(False):
            assert_close(head(x[:rows]), decode[:rows] if rows <= PANEL_MAX_ROWS[16] else exact[:rows])
        assert_close(head(x[:rows]), decode[:rows] if rows <= PANEL_MAX_ROWS[16] else exact[:rows])
    assert not torch.allclose(decode, exact, rtol=0, atol=1e-9)  # the two numerics do differ


@pytest.mark.parametrize("bits", ops.ACTIVATION_BITS)
@pytest.mark.parametrize("isa", ops.dot_isas(), ids=lambda i: ["avx2", "vnni"][i])
@pytest.mark.parametrize("group", [None, 32, 16], ids=["per-channel", "q8_0", "q6_k"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_dot_kernel_equals_its_reference(shape, group, isa, bits):
    out_features, in_features = shape
    torch.manual_seed(out_features)
    layer = Int8Linear(in_features, out_features, False, group)
    layer.q.copy_(torch.randint(-128, 128, layer.q.shape, dtype=torch.int8))  # -128 too: |w| must not overflow
    layer.scale.copy_(torch.rand(layer.scale.shape) / 100)
    for rows in range(1, ops.MAX_ROWS + 1):
        x = layer.kernel_input(torch.randn(rows, in_features))
        got = ops.int8_linear_dot(x, layer.q, layer.scale, layer.group_size, bits, isa)
        assert_close(got, ops.reference_dot_linear(x, layer.q, layer.scale, None, layer.group_size, bits))


def test_activation_blocks_round_half_to_even_within_127():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0] + [0.0] * 27, [0.0] * 32])
    codes, scales = ops.quantize_activations(x)
    assert codes[0, :5].tolist() == [127, 0, 2, -2, -127] and scales[0].item() == 1.0
    assert codes[1].abs().sum() == 0 and scales[1].item() == 0  # an all-zero block stays zero


def test_sixteen_bit_blocks_stay_within_their_two_planes():
    """16-bit codes are 128 * hi + lo with hi in [-127, 127] (INT8's sign trick negates it) and lo in
    [0, 127]: the extremes of a block land exactly on +-16256, and a plane split of every code is exact."""
    x = torch.tensor([[-3.0, 3.0, 1.0, -1.0] + [0.001 * i for i in range(28)]])
    codes, scales = ops.quantize_activations(x, 16)
    assert codes[0, :4].tolist() == [-16256, 16256, 5419, -5419] and scales[0].item() == pytest.approx(3 / 16256)
    hi, lo = torch.div(codes, 128, rounding_mode="floor"), torch.remainder(codes, 128)
    assert hi.abs().max() <= 127 and lo.min() >= 0 and lo.max() <= 127 and torch.equal(hi * 128 + lo, codes)


@pytest.mark.parametrize("bits, bound", [(8, 1e-2), (16, 1e-4)])
def test_quantized_activations_stay_near_the_exact_product(bits, bound):
    torch.manual_seed(0)
    layer = Int4Linear(576, 256, False, 32)
    layer.load_shard(None, torch.randn(256, 576))
    x = torch.randn(1, 576)
    exact = x.double() @ layer.dequantize().double().T
    fast = ops.int4_linear_dot(layer.kernel_input(x), layer.codes, layer.scale, layer.offset, 32, bits)
    assert ((fast.double() - exact).norm() / exact.norm()).item() < bound


def reference_forward(self: QuantizedLinear, x: torch.Tensor, bits: int) -> torch.Tensor:
    """QuantizedLinear.forward as the integer-dot reference computes it, for any row count."""
    wide = self.kernel_input(x).float()
    if isinstance(self, Int4Linear):
        y = ops.reference_dot_linear(wide, int4_codes(self), self.scale, self.offset, self.group_size, bits)
    else:
        y = ops.reference_dot_linear(wide, self.q, self.scale, None, self.group_size, bits)
    y = y.float()
    return y if self.bias is None else y + self.bias


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_activations_reach_every_quantized_layer_in_prefill_and_decode(tiny_checkpoint, quantization,
                                                                                  activations):
    """Every quantized linear of an engine with activation_quantization="int8" / "int16" computes the
    integer-dot reference of the input it was given, at prefill (50 rows: past the float kernel's 32)
    and decode. (Layer by layer: through a whole model the quantization's rounding amplifies float noise.)"""
    path = str(tiny_checkpoint("llama_gqa"))
    llm = LLM(path, progress=False, quantization=quantization, group_size=32, activation_quantization=activations)
    bits = {"int8": 8, "int16": 16}[activations]
    assert quantize_prefill(llm.engine.model) == 2 * 4 + 1  # prefill too, else the float GEMM (below)
    calls: dict[str, list] = {}
    layers = {name: m for name, m in llm.engine.model.named_modules() if isinstance(m, QuantizedLinear)}

    def record(name):  # copies: decode attention rotates the qkv output in place
        return lambda module, args, out: calls.setdefault(name, []).append((args[0].clone(), out.clone()))

    for name, module in layers.items():
        module.register_forward_hook(record(name))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 17, 42, 99, 123, 250, 7, 8, 9, 10] * 5}], params, use_tqdm=False)
    assert set(calls) == set(layers) and len(layers) == 2 * 4 + 1
    for name, seen in calls.items():
        assert sorted({x.shape[0] for x, _ in seen}) == ([1] if name == "lm_head" else [1, 50]), name  # head: last rows
        for x, out in seen:
            assert_close(out, reference_forward(layers[name], x, bits).double())
    exact = LLM(path, progress=False, quantization=quantization, group_size=32, activation_quantization=None)
    x = calls["lm_head"][0][0]
    assert not torch.allclose(exact.engine.model.lm_head(x), calls["lm_head"][0][1], atol=1e-6)  # numerics did change


def test_long_prefill_chunks_take_the_float_gemm_unless_asked(tiny_checkpoint):
    """With 16-bit blocks, past PANEL_MAX_ROWS[16] rows a layer computes the exact product (the float
    GEMM), as a layer with float activations does; up to it (decode batches, short prompts) the integer
    ops. With 8-bit blocks the integer kernels take every batch."""
    path = str(tiny_checkpoint("llama_gqa"))
    for activations, bits in (("int16", 16), ("int8", 8)):
        llm = LLM(path, progress=False, quantization="int4", group_size=32, activation_quantization=activations)
        layer = llm.engine.model.lm_head
        x = torch.randn(PANEL_MAX_ROWS[16] + 1, layer.in_features)
        exact = x.double() @ layer.dequantize().double().T
        for rows in (3, PANEL_MAX_ROWS[16], len(x)):
            out = layer(x[:rows]).double()
            error = ((out - exact[:rows]).norm() / exact[:rows].norm()).item()
            if bits == 16 and rows == len(x):
                assert error < 1e-6
            else:
                assert error > 1e-6
                assert_close(out, reference_forward(layer, x[:rows], bits).double())


def test_the_runner_computes_its_steps_with_the_decode_numerics(tiny_checkpoint):
    """An engine step with no prompt-logprob rows runs every layer, prefill chunks of any length included,
    inside decode_numerics; a step computing prompt logprobs, and scoring, do not."""
    path = str(tiny_checkpoint("llama_gqa"))
    llm = LLM(path, progress=False, quantization="int8", activation_quantization="int16")
    seen = []
    for layer in (llm.engine.model.model.layers[0].mlp.down_proj, llm.engine.model.lm_head):
        layer.register_forward_hook(
            lambda module, args, out: seen.append((args[0].shape[0], linear_module._DECODE_NUMERICS.get())))
    prompts = [{"prompt_token_ids": [3 + i, 9, 27]} for i in range(40)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert seen and all(on for _, on in seen) and max(rows for rows, _ in seen) == 120  # the 40 prompts' prefill
    seen.clear()
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert seen[-1] == (1 + 2, False)  # the head: the last position, then two prompt positions
    seen.clear()
    llm.engine.score([1, 2, 3, 4])
    assert seen and not any(on for _, on in seen)


def test_a_models_activation_bits_are_its_quantized_layers(tiny_checkpoint):
    from llmpipe.quant.apply import activation_bits

    path = str(tiny_checkpoint("llama_gqa"))
    assert activation_bits(LLM(path, progress=False, quantization="int4", activation_quantization="int16").engine.model) == 16
    assert activation_bits(LLM(path, progress=False, quantization="int4", activation_quantization="int8").engine.model) == 8
    assert activation_bits(LLM(path, progress=False, quantization="int4", activation_quantization=None).engine.model) is None
    assert activation_bits(LLM(path, progress=False).engine.model) is None  # float weights: no quantized layers
