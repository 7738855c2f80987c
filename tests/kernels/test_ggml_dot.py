"""The GGML kernels (csrc/ggml_rows.h, `ops.ggml_linear_dot`): a GGUF file's own blocks of every type they
read, against gguf-py's dequantized weight times the float activations, on random blocks and on weights that
gguf-py quantized, through each ISA, one- and two-plane activations and batches of every row-run length; F16 and
BF16 rows against the float activations to float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, quants
from hypothesis import given, settings, strategies as st

from llmpipe.kernels import build
from llmpipe.loader.gguf_weights import GGML_TYPES
from llmpipe.kernels import ops
from tests.loader.test_gguf_quants import RANDOM_BLOCK_SCALE_OFFSETS

pytestmark = pytest.mark.skipif(build.library() is None, reason="needs AVX2 + FMA, a C compiler and ninja")

LEVELS = {8: 127, 16: 16256}  # the activation blocks' levels (csrc lowbit_q8_rows.h Q8_LEVELS, Q16_LEVELS)
HALVES = (Q.F16, Q.BF16)
SCALE_OFFSETS = {**RANDOM_BLOCK_SCALE_OFFSETS, Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q8_0: (0,)}


def block_weights(qtype: Q) -> int:
    """Weights a kernel block holds: ggml's block, or 32 for F16 and BF16 (rows of floats, read 32 at a time)."""
    return 32 if qtype in HALVES else GGML_QUANT_SIZES[qtype][0]


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes with float16 scales (and mins), or MXFP4's exponents, of a sensible size: [rows, bytes per row].
    F16 / BF16: normal floats."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    if qtype in HALVES:
        return quants.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype).view(np.uint8)
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(blocks.shape[:2]) * 0.01).astype(np.float16)
        blocks[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    if qtype == Q.MXFP4:  # E8M0 exponents: scales 2^-10 .. 2^2
        blocks[..., 0] = rng.integers(118, 131, size=blocks.shape[:2])
    return blocks.reshape(rows, -1)


def error_bound(x: torch.Tensor, w: torch.Tensor, bits: int) -> torch.Tensor:
    """What quantizing x to blocks of 32 may move each output by: half a step of each block times the weights'
    magnitudes there, plus float32 rounding of the sums."""
    step = x.abs().unflatten(1, (-1, 32)).amax(-1) / LEVELS[bits]  # [M, K / 32]
    magnitude = w.abs().unflatten(1, (-1, 32)).sum(-1)  # [N, K / 32]
    rounding = 1e-5 * (x.abs().double() @ w.abs().double().T)
    return (step.double() / 2) @ magnitude.double().T + rounding


def check(qtype: Q, raw: np.ndarray, x: torch.Tensor) -> None:
    w = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32)).reshape(raw.shape[0], -1)
    reference = x.double() @ w.double().T
    for bits in (8, 16):
        # F16 / BF16 meet the float activations themselves: float32 rounding alone
        bound = 1e-5 * (x.abs().double() @ w.abs().double().T) if qtype in HALVES else error_bound(x, w, bits)
        for isa in ops.ggml_isas():
            y = ops.ggml_linear_dot(x, torch.from_numpy(raw), int(qtype), bits, isa)
            assert y.shape == (x.shape[0], raw.shape[0]) and y.dtype == torch.float32
            err = (y.double() - reference).abs()
            assert (err <= bound).all(), f"{qtype.name} bits {bits} isa {isa}: {(err - bound).max().item()} over"


def widths(qtype: Q) -> tuple[int, ...]:
    """Row widths: one block, an odd and an even count (the 32-weight types run sixteen, then two blocks at a
    time), and past the kernels' 1,024-weight chunks."""
    block = block_weights(qtype)
    return (block, 3 * block, 8 * block, 19 * block, 51 * block) if block == 32 else (block, 3 * block, 5 * block)


@pytest.mark.parametrize("qtype", GGML_TYPES, ids=lambda q: q.name)
def test_random_blocks_give_the_dequantized_weights_product(qtype):
    for seed, cols in enumerate(widths(qtype)):
        raw = random_blocks(qtype, 21, cols, seed)
        for rows in (1, 3, 7, 8, 13, 16, 37):  # one row run, a partial one, a whole one, two; AMX tiles from 8: one, three
            check(qtype, raw, torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("qtype", GGML_TYPES, ids=lambda q: q.name)
def test_batches_give_the_dequantized_weights_product(qtype):
    """Prefill-sized batches: on AVX2, eight weight rows at a time unpacked into a panel (from 16 activation rows,
    32 for the types that sum in int32), the rows short of a panel by the row kernels."""
    cols = 3 * block_weights(qtype) if block_weights(qtype) == 256 else 19 * 32
    raw = random_blocks(qtype, 21, cols, 7)
    for rows in (17, 33, 100):
        check(qtype, raw, torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)))


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("qtype", GGML_TYPES, ids=lambda q: q.name)
def test_panels_in_groups_and_pairs_give_the_dequantized_weights_product(qtype, threads):
    """On VNNI without AMX a batch meets panels of eight weight rows, two a 512-bit step, four packed at a time
    (csrc ggml_panels_vnni): 75 weight rows are two whole groups, a group of three panels whose last pairs with
    itself, and three rows short of a panel (at two threads each thread's share of them); 8 activation rows are the
    fewest that take them at 15 bits (12 at int8: the rows below), 16 and 21 two passes of eight and a partial one.
    The K-quants' panels are packed straight from the file's bytes (csrc k_panel_pack, q6_k_panel_pack)."""
    cols = 2 * block_weights(qtype) if block_weights(qtype) == 256 else 11 * 32
    raw = random_blocks(qtype, 75, cols, 5)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (8, 12, 16, 21):
            check(qtype, raw, torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("qtype", GGML_TYPES, ids=lambda q: q.name)
def test_large_batches_give_the_dequantized_weights_product(qtype):
    """Batches of 128 rows and more, which on AVX2 at the default numerics meet the dequantized weight as floats
    (csrc ggml_float_slice): rows past one tile of the widened weight and short of a run of three, and rows longer
    than the 1,024 weights a tile widens at a time (a chunk's tail short of one too, for the 32-weight types). On AMX,
    1,000 rows are more than one group of weight tiles' accumulators holds (groups of four tiles, csrc ggml_amx_slice)."""
    cols = 5 * 256 if block_weights(qtype) == 256 else 51 * 32
    raw = random_blocks(qtype, 131, cols, 11)
    for rows in (64, 130, 1000):
        check(qtype, raw, torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)))


@pytest.mark.parametrize("qtype", (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4), ids=lambda q: q.name)
def test_weights_gguf_quantized_give_the_dequantized_weights_product(qtype):
    """The types gguf-py quantizes (the others' blocks are random above), a real weight's blocks."""
    cols = 512
    weights = (np.random.default_rng(1).standard_normal((33, cols)) * 0.05).astype(np.float32)
    raw = quants.quantize(weights, qtype)
    check(qtype, raw, torch.randn(5, cols) * 3)


def test_mxfp4_subnormal_scales():
    """MXFP4 exponents 0 and 1 (scales 2^-128, 2^-127: subnormal floats, built apart from the rest) and 2, against
    activations of 2^100 that bring the products back among the normal floats: every ISA's scales exact."""
    cols = 19 * 32
    raw = random_blocks(Q.MXFP4, 21, cols, 0).reshape(21, -1, 17)
    raw[..., 0] = np.random.default_rng(1).integers(0, 3, size=raw.shape[:2])
    for rows in (3, 16):  # the row kernels, the AMX tiles
        check(Q.MXFP4, raw.reshape(21, -1), torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 2.0**100)


@settings(max_examples=25, deadline=None)
@given(qtype=st.sampled_from(GGML_TYPES), rows=st.integers(1, 40), n=st.integers(1, 37), blocks=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_any_shape(qtype, rows, n, blocks, seed):
    cols = blocks * block_weights(qtype)
    check(qtype, random_blocks(qtype, n, cols, seed), torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)))


def test_an_empty_batch_and_bad_blocks():
    raw = torch.from_numpy(random_blocks(Q.Q4_K, 4, 256, 0))
    assert ops.ggml_linear_dot(torch.empty(0, 256), raw, int(Q.Q4_K)).shape == (0, 4)
    with pytest.raises(RuntimeError, match="do not hold rows"):
        ops.ggml_linear_dot(torch.randn(1, 512), raw, int(Q.Q4_K))  # 512 inputs, one super-block a row
    with pytest.raises(RuntimeError, match="has no kernel"):
        ops.ggml_linear_dot(torch.randn(1, 256), raw, int(Q.IQ2_XXS))
    with pytest.raises(RuntimeError, match="bits"):
        ops.ggml_linear_dot(torch.randn(1, 256), raw, int(Q.Q4_K), bits=4)
