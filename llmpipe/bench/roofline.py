"""This machine's limits, measured on the spot: memory read bandwidth and matmul FLOP/s."""

from __future__ import annotations

import time

import torch


def _best_time(fn, repeats: int) -> float:
    fn()  # warm up: page in, pick kernels
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a streaming read of a buffer far larger than any cache (a sum over it)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best_time(buffer.sum, repeats)


def matmul_flops(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best_time(lambda: a @ b, repeats)


def integer_dot_flops(bits: int, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an INT4 layer's integer-dot panels (activations in `bits`-bit blocks) on n rows, as an
    engine step runs them: the ceiling of prefill with activation quantization, which on CPUs with
    VNNI passes the float GEMM's."""
    from llmpipe.quant.linear import Int4Linear, decode_numerics

    layer = Int4Linear(n, n, False, 32)
    layer.load_shard(None, torch.randn(n, n))
    layer.activation_bits = bits
    x = torch.randn(n, n)

    def run() -> None:
        with decode_numerics():
            layer(x)

    return 2 * n**3 / _best_time(run, repeats)


def decode_roofline_tokens_per_s(bytes_per_token: int, bandwidth: float) -> float:
    """Upper bound on batch-1 decode: every weight byte is read once per token."""
    return bandwidth / bytes_per_token
