"""A float32 product for a few activation rows (kernels/csrc/small_batch_linear.c), the torch op llmpipe::small_batch_linear.

Two to eight rows (a small decode batch, or one sequence verifying speculative tokens) are bound
by streaming the weights, like one row, yet MKL's sgemm on this kind of CPU takes 2-4x its
one-row time for them; the kernel reads each weight row once for all rows.
"""

from __future__ import annotations

import torch

from llmpipe.kernels.abi import MAX_ROWS
from llmpipe.kernels import ops

MIN_ROWS = 2  # one row stays on MKL's matrix-vector product; at most MAX_ROWS (csrc/abi.h)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        MIN_ROWS <= x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32
        and x.device.type == "cpu" and weight.shape[1] % 16 == 0 and weight.is_contiguous()
        and ops.available()
    )


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T, float32 on CPU (the op takes any M; `usable` picks where it wins)."""
    return ops.small_batch_linear(x, weight)
