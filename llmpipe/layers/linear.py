"""Linear layers tuned for decode on CPU.

A decode step multiplies a few activation rows by every weight matrix: it is a matrix-vector
product bound by how fast the weights stream from memory. MKL runs that product on one thread,
so on CPU we split the weight's output rows into one slice per thread and run the slices as a
batched matmul, which PyTorch spreads across threads: ~1.5x the bandwidth on a 2-core machine.
Larger batches (prefill) are compute-bound and go to the ordinary GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SPLIT_MAX_ROWS = 16  # above this many rows the plain GEMM wins (measured with `llmpipe bench latency`)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [rows, in] @ weight[out, in].T (+ bias), choosing the faster kernel for the shape."""
    splits = torch.get_num_threads()
    out_features, in_features = weight.shape
    if x.device.type != "cpu" or splits < 2 or x.shape[0] > SPLIT_MAX_ROWS or out_features % splits:
        return F.linear(x, weight, bias)
    slices = weight.view(splits, out_features // splits, in_features).transpose(1, 2)
    y = torch.bmm(x.unsqueeze(0).expand(splits, -1, -1), slices)  # [splits, rows, out / splits]
    y = y.transpose(0, 1).reshape(x.shape[0], out_features)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
