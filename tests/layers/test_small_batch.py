"""The small-batch float32 kernel equals PyTorch's matmul for every row count it takes."""

import pytest
import torch

from llmpipe.layers import small_batch
from llmpipe.layers.linear import linear


@pytest.mark.skipif(not small_batch.ops.available(), reason="needs AVX2 + FMA and a C compiler")
@pytest.mark.parametrize("rows", range(small_batch.MIN_ROWS, small_batch.MAX_ROWS + 1))
def test_kernel_matches_matmul(rows):
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, 96), torch.randn(200, 96), torch.randn(200)
    assert small_batch.usable(x, weight)
    torch.testing.assert_close(linear(x, weight, bias), x @ weight.T + bias, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x[:, :48], weight[:, :48].contiguous()), x[:, :48] @ weight[:, :48].T, rtol=1e-5, atol=1e-4)


def test_other_shapes_take_pytorch():
    assert not small_batch.usable(torch.randn(1, 96), torch.randn(8, 96))  # one row: MKL's GEMV
    assert not small_batch.usable(torch.randn(9, 96), torch.randn(8, 96))
    assert not small_batch.usable(torch.randn(4, 40), torch.randn(8, 40))  # K not a multiple of 16
    assert not small_batch.usable(torch.randn(4, 96).bfloat16(), torch.randn(8, 96).bfloat16())
