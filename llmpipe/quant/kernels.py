"""The low-bit decode kernels (kernels/csrc/lowbit_linear.c), called via ctypes.

PyTorch 2.13's CPU low-bit kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) are
fast on this kind of CPU only with bfloat16 activations, and return bfloat16: measured on
SmolLM2 that moves greedy decoding off the float model's tokens at a step where the float
top-2 margin is 0.017. These kernels keep activations, scales and accumulation in float32.
Where the library cannot be built or loaded, `available()` is False and layers dequantize instead.
"""

from __future__ import annotations

import torch

from llmpipe.kernels.build import I64, PTR, KernelLibrary

MAX_ROWS = 8  # rows per call (csrc MAX_ROWS)
CHUNK = 32  # K (padded) and group sizes are multiples of this
_library = KernelLibrary(
    "lowbit_linear",
    int4_linear=[PTR, PTR, PTR, PTR, PTR, I64, I64, I64, I64],
    int8_linear=[PTR, PTR, PTR, PTR, I64, I64, I64, I64],
)


def available() -> bool:
    return _library() is not None


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] float32 contiguous → [M, N] float32."""
    y = torch.empty(x.shape[0], codes.shape[0], dtype=torch.float32)
    _library().int4_linear(
        x.data_ptr(), codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), y.data_ptr(),
        x.shape[0], codes.shape[0], x.shape[1], group,
    )
    return y


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], codes.shape[0], dtype=torch.float32)
    _library().int8_linear(
        x.data_ptr(), codes.data_ptr(), scale.data_ptr(), y.data_ptr(), x.shape[0], codes.shape[0], x.shape[1], group
    )
    return y
