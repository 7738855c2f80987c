"""The low-bit decode kernels, the torch ops torch.ops.llmpipe.* (kernels/csrc/ops.cpp): float activations (kernels/csrc/lowbit_linear.c,
the exact path) or int8-quantized activation blocks with integer dot products
(kernels/csrc/lowbit_dot.c, the fast path, as llama.cpp computes; `reference_q8_linear` is its
PyTorch reference).

PyTorch 2.13's CPU low-bit kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) are
fast on this kind of CPU only with bfloat16 activations, and return bfloat16: measured on
SmolLM2 that moves greedy decoding off the float model's tokens at a step where the float
top-2 margin is 0.017. These kernels keep activations, scales and accumulation in float32.
Where the library cannot be built or loaded, `available()` is False and layers dequantize instead.
"""

from __future__ import annotations

import torch

from llmpipe.kernels.build import library as _library

MAX_ROWS = 8  # rows per call (csrc MAX_ROWS)
CHUNK = 32  # K (padded) and group sizes are multiples of this
Q8_BLOCK = 32  # activation elements sharing one int8 scale


def available() -> bool:
    return _library() is not None


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] float32 contiguous → [M, N] float32."""
    return _library().int4_linear(x, codes, scale, offset, group)


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return _library().int8_linear(x, codes, scale, group)


def dot_available() -> bool:
    return _library() is not None  # one library holds both kinds of kernel


def dot_isas() -> list[int]:
    """The integer-dot code paths this CPU runs: 0 (AVX2) and, with AVX512-VNNI, 1."""
    return [0, 1] if dot_available() and _library().has_vnni() else [0]


def int4_linear_q8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int,
                   isa: int = 1) -> torch.Tensor:
    """As int4_linear, with x quantized to int8 blocks (`isa` 0 forces the AVX2 path)."""
    return _library().int4_linear_q8(x, codes, scale, offset, group, isa)


def int8_linear_q8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int, isa: int = 1) -> torch.Tensor:
    return _library().int8_linear_q8(x, codes, scale, group, isa)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 → (codes [M, K] as float, integers in [-127, 127]; scales [M, K / 32]):
    per block of 32, scale = max|x| / 127 and code = round-half-even(x * (127 / max|x|)), the float32
    arithmetic the kernel does."""
    blocks = x.view(x.shape[0], -1, Q8_BLOCK)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(blocks * inv[..., None]).flatten(1), amax / 127.0


def reference_q8_linear(x: torch.Tensor, weight_codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                        group: int) -> torch.Tensor:
    """What the integer-dot kernels compute, in float64: weight_codes [N, K] unpacked integer codes,
    scale / offset [N, groups]; the offset meets the exact sum of x over each group."""
    q, d = quantize_activations(x)
    dots = torch.einsum("mbk,nbk->mnb", q.double().view(x.shape[0], -1, Q8_BLOCK),
                        weight_codes.double().view(weight_codes.shape[0], -1, Q8_BLOCK))
    chunk_group = torch.arange(dots.shape[-1]) * Q8_BLOCK // group
    y = (dots * d.double()[:, None, :] * scale.double()[None, :, chunk_group]).sum(-1)
    if offset is not None:
        group_sums = torch.zeros(x.shape[0], offset.shape[1], dtype=torch.float64)
        group_sums.index_add_(1, torch.arange(x.shape[1]) // group, x.double())
        y += group_sums @ offset.double().T
    return y
