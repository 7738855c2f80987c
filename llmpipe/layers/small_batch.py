"""A float32 product for a few activation rows (csrc/small_batch_linear.c), called via ctypes.

Two to eight rows (a small decode batch, or one sequence verifying speculative tokens) are bound
by streaming the weights, like one row, yet MKL's sgemm on this kind of CPU takes 2-4x its
one-row time for them; the kernel reads each weight row once for all rows.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmpipe.quant.kernels import compile_library

SOURCE = Path(__file__).parent / "csrc" / "small_batch_linear.c"
MIN_ROWS, MAX_ROWS = 2, 8  # one row stays on MKL's matrix-vector product
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = compile_library(SOURCE)
    if lib is not None:
        lib.small_batch_linear.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _I64]
    return lib


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        MIN_ROWS <= x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32
        and x.device.type == "cpu" and weight.shape[1] % 16 == 0 and weight.is_contiguous()
        and _library() is not None
    )


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T for 2 <= M <= 8, float32 on CPU."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _library().small_batch_linear(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
    return y
