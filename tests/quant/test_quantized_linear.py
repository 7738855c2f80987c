"""Quantized linear layers against the reference: dequantize the weight, then a float64 matmul."""

from __future__ import annotations

import pytest
import torch

from llmpipe.kernels import ops
from llmpipe.quant.formats import Int4Weight, Int8Weight
from llmpipe.quant.linear import Int4Linear, Int8Linear

ROWS = (1, 3, 8, 9, 40)  # one kernel call, slices of kernel calls, dequantize + GEMM (> 32)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def assert_matches_reference(layer, weight: torch.Tensor) -> None:
    torch.manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, layer.in_features)
        expected = reference(x, weight, layer.bias)
        got = layer(x).double()
        assert ((got - expected).norm() / expected.norm()).item() < 1e-5, rows


def int4_layer(out_features: int, in_features: int, group: int, bias: bool = False) -> tuple[Int4Linear, torch.Tensor]:
    torch.manual_seed(0)
    layer = Int4Linear(in_features, out_features, bias, group)
    if bias:
        layer.bias.data = torch.randn(out_features)
    layer.load_shard(None, torch.randn(out_features, in_features))
    return layer, layer.dequantize()


@pytest.mark.parametrize("shape", [(96, 64), (960, 576), (51, 576), (50, 100), (64, 112)])  # 51: an odd row count
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_linear_equals_dequantize_then_matmul(shape, group):
    layer, weight = int4_layer(*shape, group, bias=True)
    assert_matches_reference(layer, weight)


@pytest.mark.parametrize("shape", [(96, 64), (51, 100)])
def test_int8_linear_equals_dequantize_then_matmul(shape):
    torch.manual_seed(0)
    layer = Int8Linear(shape[1], shape[0])
    w = torch.randn(*shape)
    layer.load_shard(None, w)
    weight = layer.dequantize()
    assert ((weight - w).abs() <= w.abs().amax(dim=1, keepdim=True) / 127 / 2 + 1e-6).all()  # RTN error bound
    assert_matches_reference(layer, weight)


def test_grouped_int8_from_q8_0_blocks_is_exact():
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (64, 96), dtype=torch.int8)
    scale = torch.rand(64, 3) / 100
    weight = Int8Weight(q, scale, 32)
    layer = Int8Linear(96, 64, group_size=32)
    layer.load_shard(None, weight)
    assert torch.equal(layer.dequantize(), weight.dequantize())
    assert_matches_reference(layer, weight.dequantize())


@pytest.mark.parametrize("in_features", [96, 2048])
def test_int8_half_groups_from_q6_k_sub_blocks_are_exact(in_features):
    """Groups of 16 (two scales per 32-weight chunk, GGUF Q6_K's): each half meets its own scale."""
    torch.manual_seed(0)
    q = torch.randint(-32, 32, (51, in_features), dtype=torch.int8)
    scale = torch.rand(51, in_features // 16) / 100
    weight = Int8Weight(q, scale, 16)
    layer = Int8Linear(in_features, 51, group_size=16)
    layer.load_shard(None, weight)
    assert torch.equal(layer.dequantize(), weight.dequantize())
    assert_matches_reference(layer, weight.dequantize())


def test_int4_pack_keeps_exact_scale_and_offset():
    """Q4_1-style (scale, offset) pairs are kept as given, not requantized."""
    torch.manual_seed(0)
    weight = Int4Weight(torch.randint(0, 16, (64, 96), dtype=torch.uint8), torch.rand(64, 3), torch.randn(64, 3), 32)
    layer = Int4Linear(96, 64, group_size=32)
    layer.load_shard(None, weight)
    assert torch.equal(layer.dequantize(), weight.dequantize())


def test_stacked_shards_pack_into_one_matrix():
    torch.manual_seed(0)
    layer = Int4Linear(64, 96, group_size=32)
    layer.shard_sizes = (64, 16, 16)
    parts = [torch.randn(n, 64) for n in layer.shard_sizes]
    for shard in (2, 0, 1):  # any arrival order
        layer.load_shard(shard, parts[shard])
    alone = [Int4Linear(64, n, group_size=32) for n in layer.shard_sizes]
    for single, part in zip(alone, parts):
        single.load_shard(None, part)
    assert torch.equal(layer.dequantize(), torch.cat([s.dequantize() for s in alone]))


def test_act_order_permutation_reads_columns_in_order():
    torch.manual_seed(0)
    perm = torch.randperm(64)
    weight = Int4Weight(torch.randint(0, 16, (32, 64), dtype=torch.uint8), torch.rand(32, 2), torch.randn(32, 2), 32, perm)
    layer = Int4Linear(64, 32, group_size=32)
    layer.load_shard(None, weight)
    assert torch.equal(layer.dequantize(), weight.dequantize())
    assert_matches_reference(layer, weight.dequantize())
    rows = torch.tensor([0, 5, 31])
    assert torch.allclose(layer.embed(rows), weight.dequantize()[rows])


def test_embedding_rows_are_the_dequantized_weight_rows():
    layer, weight = int4_layer(96, 64, 32)
    rows = torch.tensor([0, 17, 95, 17])
    assert torch.equal(layer.embed(rows), weight[rows])


def test_layers_fall_back_to_dequantize_without_the_kernels(monkeypatch):
    layer, weight = int4_layer(96, 64, 32)
    monkeypatch.setattr(ops, "available", lambda: False)
    assert_matches_reference(layer, weight)


def assert_c_dequantizes_to_pytorchs_bits(layer, monkeypatch) -> None:
    """The C pass — whole weights (the float GEMM of long prefill chunks) and an embedding lookup's rows
    — against the PyTorch dequantization: equal bit for bit, narrow last groups included."""
    if not ops.available():
        pytest.skip("no C compiler / AVX2: PyTorch dequantizes")
    assert layer._dequantizes_in_c()
    rows = torch.tensor([0, layer.out_features - 1, 3, 0])
    in_c = layer.kernel_weight(), layer.kernel_weight(rows)
    monkeypatch.setattr(layer, "_dequantizes_in_c", lambda: False)
    reference = layer.kernel_weight()
    assert torch.equal(in_c[0], reference)
    assert torch.equal(in_c[1], reference[rows])
    assert torch.equal(layer.kernel_weight(rows), reference[rows])


@pytest.mark.parametrize("shape, group", [((96, 64), 32), ((51, 576), 128), ((40, 160), 64)], ids=str)
def test_int4_weights_dequantize_in_c_to_pytorchs_bits(shape, group, monkeypatch):
    layer, _ = int4_layer(*shape, group)
    layer.offset.copy_(torch.randn(layer.offset.shape))
    assert_c_dequantizes_to_pytorchs_bits(layer, monkeypatch)


@pytest.mark.parametrize("group", [None, 32, 16], ids=["per-channel", "q8_0", "q6_k"])
def test_int8_weights_dequantize_in_c_to_pytorchs_bits(group, monkeypatch):
    layer = Int8Linear(96, 37, False, group)
    layer.q.copy_(torch.randint(-128, 128, layer.q.shape, dtype=torch.int8))
    layer.scale.copy_(torch.rand(layer.scale.shape) / 100)
    assert_c_dequantizes_to_pytorchs_bits(layer, monkeypatch)
