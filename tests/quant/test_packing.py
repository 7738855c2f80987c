"""GPTQ / AWQ packing against hand-computed bit arithmetic and an unpacking written from the
layouts' definitions (AutoGPTQ's `QuantLinear.pack`, AutoAWQ's `WQLinear_GEMM.from_linear`)."""

import pytest
import torch

from llmpipe.quant.formats import Int4Weight
from llmpipe.quant.packing import pack_awq, pack_gptq, unpack_awq, unpack_gptq
from llmpipe.quant.rtn import quantize_int4
from tests.quant.reference import AWQ_ORDER as ORDER
from tests.quant.reference import reference_awq_weight, reference_gptq_weight

def as_int32(value: int) -> int:
    return value - 2**32 if value >= 2**31 else value


def nibble(word: int, k: int) -> int:
    return ((word & 0xFFFFFFFF) >> (4 * k)) & 0xF


def patterned(out_features=8, in_features=16, group=8, perm=None) -> tuple[Int4Weight, torch.Tensor]:
    """Codes (3o + i) mod 16, zero points 1 + (o + g) mod 15, scales exact in float16."""
    groups = -(-in_features // group)
    o, i = torch.meshgrid(torch.arange(out_features), torch.arange(in_features), indexing="ij")
    q = ((3 * o + i) % 16).to(torch.uint8)
    og, gg = torch.meshgrid(torch.arange(out_features), torch.arange(groups), indexing="ij")
    zero = 1 + (og + gg) % 15
    scale = (og + 1) * (gg + 1) / 64.0
    return Int4Weight(q, scale, -zero * scale, group, perm), zero


def test_gptq_words_by_hand():
    weight, zero = patterned()
    packed = pack_gptq(weight)
    q = weight.q.tolist()
    for r in range(2):
        for o in range(8):
            assert packed["qweight"][r, o].item() == as_int32(sum(q[o][8 * r + j] << (4 * j) for j in range(8)))
    for g in range(2):
        assert packed["qzeros"][g, 0].item() == as_int32(sum((zero[j, g].item() - 1) << (4 * j) for j in range(8)))
    assert packed["qweight"].dtype == packed["qzeros"].dtype == packed["g_idx"].dtype == torch.int32
    assert packed["scales"].dtype == torch.float16 and torch.equal(packed["scales"].float(), weight.scale.T)
    assert packed["g_idx"].tolist() == [i // 8 for i in range(16)]


def test_awq_words_by_hand():
    weight, zero = patterned(out_features=16, in_features=8)
    packed = pack_awq(weight)
    q = weight.q.tolist()
    for i in range(8):
        for c in range(2):
            expected = sum(q[8 * c + ORDER[k]][i] << (4 * k) for k in range(8))
            assert packed["qweight"][i, c].item() == as_int32(expected)
    for c in range(2):
        expected = sum(zero[8 * c + ORDER[k], 0].item() << (4 * k) for k in range(8))
        assert packed["qzeros"][0, c].item() == as_int32(expected)
    assert packed["qweight"].shape == (8, 2) and packed["scales"].shape == (1, 16)


def fp16_scales(weight: Int4Weight) -> Int4Weight:
    """The same weight with float16-rounded scales (what the files hold)."""
    zero = (-weight.offset / weight.scale).round()
    scale = weight.scale.half().float()
    return Int4Weight(weight.q, scale, -zero * scale, weight.group_size, weight.in_perm)


@pytest.mark.parametrize("in_features", [32, 40], ids=["whole groups", "partial last group"])
def test_gptq_file_layout_dequantizes_like_the_definition(in_features):
    torch.manual_seed(0)
    weight = quantize_int4(torch.randn(16, in_features), 16, min_zero=1)
    packed = pack_gptq(weight)
    reference = reference_gptq_weight(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"])
    torch.testing.assert_close(reference, fp16_scales(weight).dequantize())
    unpacked = unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 16)
    torch.testing.assert_close(unpacked.dequantize(), reference)


def test_gptq_act_order_g_idx_round_trip():
    torch.manual_seed(1)
    base = quantize_int4(torch.randn(8, 32), 8, min_zero=1)
    perm = torch.randperm(32)
    weight = Int4Weight(base.q, base.scale.half().float(), base.offset / base.scale * base.scale.half().float(), 8, perm)
    packed = pack_gptq(weight)
    assert sorted(packed["g_idx"].tolist()) == [i // 8 for i in range(32)]
    assert packed["g_idx"].tolist() != [i // 8 for i in range(32)]
    reference = reference_gptq_weight(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"])
    torch.testing.assert_close(reference, weight.dequantize())
    unpacked = unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 8)
    assert unpacked.in_perm is not None
    torch.testing.assert_close(unpacked.dequantize(), reference)


@pytest.mark.parametrize("in_features", [32, 40], ids=["whole groups", "partial last group"])
def test_awq_file_layout_dequantizes_like_the_definition(in_features):
    torch.manual_seed(2)
    weight = quantize_int4(torch.randn(24, in_features), 16)
    packed = pack_awq(weight)
    reference = reference_awq_weight(packed["qweight"], packed["qzeros"], packed["scales"], 16)
    torch.testing.assert_close(reference, fp16_scales(weight).dequantize())
    unpacked = unpack_awq(packed["qweight"], packed["qzeros"], packed["scales"], 16)
    torch.testing.assert_close(unpacked.dequantize(), reference)


def test_gptq_layout_refuses_zero_point_zero():
    weight = quantize_int4(torch.tensor([[0.1, 0.5, 0.9, 1.5] * 2]), 8)  # all positive → zero point 0
    with pytest.raises(ValueError, match="zero point 0"):
        pack_gptq(weight)


def test_g_idx_with_uneven_groups_is_rejected():
    weight, _ = patterned()
    packed = pack_gptq(weight)
    bad = torch.tensor([0] * 9 + [1] * 7, dtype=torch.int32)
    with pytest.raises(ValueError, match="groups of 8"):
        unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], bad, 8)
