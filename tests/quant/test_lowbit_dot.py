"""The integer-dot kernels (int8 activation blocks x 4/8-bit codes) against their float64 PyTorch
reference, on every code path this CPU runs (AVX2, and AVX512-VNNI where present)."""

from __future__ import annotations

import pytest
import torch

from llmpipe import LLM, SamplingParams
from llmpipe.quant import kernels
from llmpipe.quant.linear import Int4Linear, Int8Linear, QuantizedLinear

pytestmark = pytest.mark.skipif(not kernels.dot_available(), reason="needs AVX2 + FMA and a C compiler")
SHAPES = [(96, 64), (50, 576), (64, 96), (33, 1536)]  # K = 96: an odd chunk count; 576 at g128: a narrow last group


def int4_codes(layer: Int4Linear) -> torch.Tensor:
    chunks = layer.codes.view(layer.codes.shape[0], -1, kernels.CHUNK // 2)
    return torch.stack([chunks & 15, chunks >> 4], dim=2).flatten(1)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("isa", kernels.dot_isas(), ids=lambda i: ["avx2", "vnni"][i])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int4_dot_kernel_equals_its_reference(shape, group, isa):
    out_features, in_features = shape
    torch.manual_seed(out_features + group)
    layer = Int4Linear(in_features, out_features, False, group)
    layer.load_shard(None, torch.randn(out_features, in_features))
    for rows in range(1, kernels.MAX_ROWS + 1):
        x = layer.kernel_input(torch.randn(rows, in_features))
        got = kernels.int4_linear_q8(x, layer.codes, layer.scale, layer.offset, group, isa)
        assert_close(got, kernels.reference_q8_linear(x, int4_codes(layer), layer.scale, layer.offset, group))


@pytest.mark.parametrize("isa", kernels.dot_isas(), ids=lambda i: ["avx2", "vnni"][i])
@pytest.mark.parametrize("grouped", [False, True], ids=["per-channel", "q8_0"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_dot_kernel_equals_its_reference(shape, grouped, isa):
    out_features, in_features = shape
    torch.manual_seed(out_features)
    layer = Int8Linear(in_features, out_features, False, 32 if grouped else None)
    layer.q.copy_(torch.randint(-128, 128, layer.q.shape, dtype=torch.int8))  # -128 too: |w| must not overflow
    layer.scale.copy_(torch.rand(layer.scale.shape) / 100)
    for rows in range(1, kernels.MAX_ROWS + 1):
        x = layer.kernel_input(torch.randn(rows, in_features))
        got = kernels.int8_linear_q8(x, layer.q, layer.scale, layer.group_size, isa)
        assert_close(got, kernels.reference_q8_linear(x, layer.q, layer.scale, None, layer.group_size))


def test_activation_blocks_round_half_to_even_within_127():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0] + [0.0] * 27, [0.0] * 32])
    codes, scales = kernels.quantize_activations(x)
    assert codes[0, :5].tolist() == [127, 0, 2, -2, -127] and scales[0].item() == 1.0
    assert codes[1].abs().sum() == 0 and scales[1].item() == 0  # an all-zero block stays zero


def test_quantized_activations_stay_near_the_exact_product():
    torch.manual_seed(0)
    layer = Int4Linear(576, 256, False, 32)
    layer.load_shard(None, torch.randn(256, 576))
    x = torch.randn(1, 576)
    exact = x.double() @ layer.dequantize().double().T
    fast = kernels.int4_linear_q8(layer.kernel_input(x), layer.codes, layer.scale, layer.offset, 32)
    assert ((fast.double() - exact).norm() / exact.norm()).item() < 0.01


def reference_forward(self: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """QuantizedLinear.forward as the integer-dot reference computes it, for any row count."""
    wide = self.kernel_input(x).float()
    if isinstance(self, Int4Linear):
        y = kernels.reference_q8_linear(wide, int4_codes(self), self.scale, self.offset, self.group_size)
    else:
        y = kernels.reference_q8_linear(wide, self.q, self.scale, None, self.group_size)
    y = y.float()
    return y if self.bias is None else y + self.bias


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_int8_activations_reach_every_quantized_layer_in_prefill_and_decode(tiny_checkpoint, quantization):
    """Every quantized linear of an engine with activation_quantization="int8" computes the integer-dot
    reference of the input it was given, at prefill (50 rows: past the float kernel's 32) and decode.
    (Layer by layer: through a whole model the quantization's rounding amplifies float noise.)"""
    path = str(tiny_checkpoint("llama_gqa"))
    llm = LLM(path, progress=False, quantization=quantization, group_size=32, activation_quantization="int8")
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
            assert_close(out, reference_forward(layers[name], x).double())
    exact = LLM(path, progress=False, quantization=quantization, group_size=32)
    x = calls["lm_head"][0][0]
    assert not torch.allclose(exact.engine.model.lm_head(x), calls["lm_head"][0][1], atol=1e-6)  # numerics did change
