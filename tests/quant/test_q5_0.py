"""GGUF Q5_0 weights kept as the file's blocks: the C unpacking against gguf-py's dequantization, the Q5_0
ops against the INT8 ops on the same codes (bit for bit) and against a float64 reference, and Q5_0Linear
against Int8Linear holding the same weight, at every batch size and activation numerics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from llmpipe.kernels import ops
from llmpipe.quant.formats import Q5_0Weight
from llmpipe.quant.linear import Int8Linear, Q5_0Linear, decode_numerics

pytestmark = pytest.mark.skipif(not ops.dot_available(), reason="needs AVX2 + FMA and a C compiler")
SHAPES = [(67, 640), (40, 96), (9, 32)]  # odd row counts (a batch-1 pair left over); 1 and 3 blocks a row


def q5_0_blocks(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF Q5_0 blocks uint8 [out, in / 32 * 22], ggml's dequantized float32 weight) of a random weight."""
    rng = np.random.default_rng(seed)
    raw = quants.quantize(rng.standard_normal((out_features, in_features), dtype=np.float32), GGMLQuantizationType.Q5_0)
    weight = quants.dequantize(raw, GGMLQuantizationType.Q5_0).astype(np.float32)
    return torch.from_numpy(raw).reshape(out_features, -1).contiguous(), torch.from_numpy(weight)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_c_unpacking_gives_ggmls_weights_as_int8_codes_and_scales(shape):
    blocks, weight = q5_0_blocks(*shape)
    codes, scale = ops.q5_0_unpack(blocks)
    assert codes.dtype == torch.int8 and int(codes.min()) >= -16 and int(codes.max()) <= 15
    assert torch.equal((codes.float().unflatten(1, (-1, 32)) * scale[..., None]).flatten(1), weight)
    python = Q5_0Weight(blocks).to_int8()
    assert torch.equal(codes, python.q) and torch.equal(scale, python.scale)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_exact_q5_0_kernel_is_the_int8_kernel_on_the_unpacked_codes(shape):
    blocks, weight = q5_0_blocks(*shape)
    codes, scale = ops.q5_0_unpack(blocks)
    for rows in range(1, ops.MAX_ROWS + 1):
        x = torch.randn(rows, shape[1])
        got = ops.q5_0_linear(x, blocks)
        assert torch.equal(got, ops.int8_linear(x, codes, scale, 32))
        assert relative_error(got, x.double() @ weight.double().T) < 1e-6


@pytest.mark.parametrize("bits", ops.ACTIVATION_BITS)
@pytest.mark.parametrize("isa", ops.dot_isas(), ids=lambda i: ["avx2", "vnni"][i])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_integer_dot_q5_0_kernel_is_the_int8_one_on_the_unpacked_codes(shape, isa, bits):
    blocks, _ = q5_0_blocks(*shape)
    codes, scale = ops.q5_0_unpack(blocks)
    for rows in range(1, ops.MAX_ROWS + 1):
        x = torch.randn(rows, shape[1])
        got = ops.q5_0_linear_dot(x, blocks, bits, isa)
        assert torch.equal(got, ops.int8_linear_dot(x, codes, scale, 32, bits, isa))
        assert relative_error(got, ops.reference_dot_linear(x, codes, scale, None, 32, bits)) < 1e-6


def twin_layers(out_features: int, in_features: int, bias: bool) -> tuple[Q5_0Linear, Int8Linear]:
    blocks, _ = q5_0_blocks(out_features, in_features, seed=out_features)
    q5, q8 = Q5_0Linear(in_features, out_features, bias), Int8Linear(in_features, out_features, bias, 32)
    q5.load_shard(None, Q5_0Weight(blocks))
    q8.load_shard(None, Q5_0Weight(blocks))  # Int8Linear holds a Q5_0 shard as its int8 codes
    if bias:
        q5.bias.data.normal_()
        q8.bias.data.copy_(q5.bias.data)
    return q5, q8


@pytest.mark.parametrize("activation_bits", [None, *ops.ACTIVATION_BITS])
def test_a_q5_0_layer_computes_what_int8linear_computes_on_the_same_weight(activation_bits):
    """Batch 1, row-kernel batches, panels (with activation quantization), the float GEMM past 32 rows,
    and every row in an engine step: the same bits as Int8Linear, and the same embedding rows."""
    torch.manual_seed(0)
    q5, q8 = twin_layers(45, 160, bias=True)
    q5.activation_bits = q8.activation_bits = activation_bits
    assert q5.blocks.numel() < 0.7 * q8.q.numel()  # 22 bytes a block of 32 where int8 holds 32 + scales
    for rows in (1, 2, 5, 8, 11, 40):
        x = torch.randn(rows, 160)
        assert torch.equal(q5(x), q8(x)), rows
        with decode_numerics():
            assert torch.equal(q5(x), q8(x)), rows
    ids = torch.tensor([0, 44, 7, 7])
    assert torch.equal(q5.embed(ids), q8.embed(ids))
    assert torch.equal(q5.dequantize(), q8.dequantize())


def test_a_q5_0_layer_refuses_what_is_not_whole_blocks():
    with pytest.raises(ValueError, match="whole blocks of 32"):
        Q5_0Linear(48, 8)
    with pytest.raises(ValueError, match="come from GGUF"):
        Q5_0Linear(64, 8).load_shard(None, torch.randn(8, 64))
