"""Linear layers tuned for decode on CPU.

A decode step multiplies a few activation rows by every weight matrix: it is a matrix-vector
product bound by how fast the weights stream from memory. MKL runs that product on one thread,
so on CPU we split the weight's output rows into one slice per thread and run the slices as a
batched matmul, which PyTorch spreads across threads: ~1.5x the bandwidth on a 2-core machine.
Two to eight rows in float32 go to a C kernel (layers/small_batch.py) that reads the weights once.
Larger batches (prefill) are compute-bound and go to the ordinary GEMM; on CPUs without bf16
matrix instructions that GEMM runs in float32 (bf16 GEMM there is ~10x slower than widening first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmpipe.layers import small_batch

SPLIT_MAX_ROWS = 16  # above this many rows the plain GEMM wins (measured with `llmpipe bench latency`)
_NATIVE_HALF_GEMM = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, splits: int = 1) -> torch.Tensor:
    """x: [rows, in] @ weight[out, in].T (+ bias), choosing the faster kernel for the shape.
    splits: how many slices the small-batch product is cut into (the thread count)."""
    out_features, in_features = weight.shape
    on_cpu = x.device.type == "cpu"
    if on_cpu and x.shape[0] > SPLIT_MAX_ROWS and weight.dtype != torch.float32 and not _NATIVE_HALF_GEMM:
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)
    if on_cpu and small_batch.usable(x, weight):
        y = small_batch.small_batch_linear(x, weight)
        return y if bias is None else y + bias
    if not on_cpu or splits < 2 or x.shape[0] > SPLIT_MAX_ROWS or out_features % splits:
        return F.linear(x, weight, bias)
    slices = weight.view(splits, out_features // splits, in_features).transpose(1, 2)
    y = torch.bmm(x.expand(splits, -1, -1), slices)  # [splits, rows, out / splits]
    y = y.view(1, out_features) if x.shape[0] == 1 else y.transpose(0, 1).reshape(x.shape[0], out_features)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias)
        self.splits = torch.get_num_threads()  # fixed when the model is built (the engine sets threads first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.splits)
