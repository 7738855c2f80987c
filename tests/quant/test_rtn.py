"""Round-to-nearest quantizers against hand-computed arithmetic."""

import torch

from llmpipe.quant.rtn import quantize_int4, quantize_int8


def test_int4_group_scale_zero_and_codes_by_hand():
    # One group of 4: min −1, max 2 → scale 3/15 = 0.2, zero round(1/0.2) = 5.
    w = torch.tensor([[-1.0, 0.0, 0.65, 2.0]])
    q = quantize_int4(w, group_size=4)
    torch.testing.assert_close(q.scale, torch.tensor([[0.2]]))
    torch.testing.assert_close(q.offset, torch.tensor([[-1.0]]))  # −zero·scale
    # codes round(w / 0.2) + 5 = [−5, 0, 3.25 → 3, 10] + 5
    assert q.q.tolist() == [[0, 5, 8, 15]]
    torch.testing.assert_close(q.dequantize(), torch.tensor([[-1.0, 0.0, 0.6, 2.0]]))


def test_int4_partial_last_group_has_its_own_min_and_max():
    torch.manual_seed(0)
    w = torch.randn(6, 10)  # groups of 4: columns 0-3, 4-7, and a partial 8-9
    q = quantize_int4(w, group_size=4)
    assert q.scale.shape == (6, 3) and q.offset.shape == (6, 3)
    for g, cols in enumerate([slice(0, 4), slice(4, 8), slice(8, 10)]):
        part = w[:, cols]
        scale = (part.amax(1) - part.amin(1)) / 15
        zero = (-part.amin(1) / scale).round().clamp(0, 15)
        expected = ((part / scale[:, None]).round() + zero[:, None]).clamp(0, 15)
        assert torch.equal(q.q[:, cols].long(), expected.long())
        torch.testing.assert_close(q.dequantize()[:, cols], (expected - zero[:, None]) * scale[:, None])


def test_int4_min_zero_keeps_zero_points_at_least_one():
    w = torch.tensor([[0.1, 0.5, 0.9, 1.5]])  # all positive: the plain zero point is 0
    assert quantize_int4(w, 4).offset.item() == 0
    q = quantize_int4(w, 4, min_zero=1)
    assert round(-q.offset.item() / q.scale.item()) == 1


def test_int8_symmetric_per_row_by_hand():
    w = torch.tensor([[-2.54, 1.0, 0.0], [0.5, 0.25, -0.125]])
    q = quantize_int8(w)
    torch.testing.assert_close(q.scale, torch.tensor([2.54 / 127, 0.5 / 127]))
    assert q.q.tolist() == [[-127, 50, 0], [127, 64, -32]]  # 1/0.02 = 50; 0.25·254 = 63.5 → 64
