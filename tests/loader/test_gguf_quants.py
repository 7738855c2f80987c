"""llmpipe's torch dequantizers against gguf.quants, the reference, one ggml type at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from llmpipe.loader.gguf_quants import SUPPORTED_TYPES, dequantize, mxfp4_from_hf, split_q4_0, split_q4_1, split_q8_0

Q = GGMLQuantizationType
ROWS, COLS = 48, 768  # three 256-weight super-blocks per row

# Types gguf.quants can quantize: round-trip real float data through them.
QUANTIZABLE = [Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4]
# Random bytes (every bit pattern; the only way for K-quants and IQ types, which gguf.quants only
# dequantizes), with finite float16 scales at these offsets (MXFP4 has none: its E8M0 exponent byte takes
# every value whose weights are finite, the subnormal scales of 0 and 1 too).
RANDOM_BLOCK_SCALE_OFFSETS = {
    Q.Q5_1: (0, 2), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.MXFP4: (),
}


def random_weights(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    weights[0, :32] = 0.0  # an all-zero block (scale 0)
    weights[1, :32] = 3.0  # a constant block (min == max)
    return weights


def random_blocks(qtype: GGMLQuantizationType, seed: int = 0, shape: tuple[int, int] = (ROWS, COLS),
                  scale: float = 0.01) -> np.ndarray:
    """Raw blocks [rows, bytes per row] of random bytes whose float16 scales are normal(0, scale)."""
    (rows, cols), (block_size, type_size) = shape, GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in RANDOM_BLOCK_SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(blocks.shape[:2]) * scale).astype(np.float16)
        blocks[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    if qtype == Q.MXFP4:  # exponents up to 252: 12 · 2^(e − 128) stays a finite float32
        blocks[..., 0] = rng.integers(0, 253, size=blocks.shape[:2])
    return blocks.reshape(rows, -1)


def assert_matches_reference(raw: np.ndarray, qtype: GGMLQuantizationType) -> None:
    expected = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))
    actual = dequantize(torch.from_numpy(raw), qtype, (ROWS, COLS)).float()
    assert actual.shape == expected.shape
    assert torch.equal(actual, expected), f"max diff {(actual - expected).abs().max()}"


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_dequantize_matches_gguf_reference_on_quantized_weights(qtype):
    assert_matches_reference(quants.quantize(random_weights(), qtype), qtype)


@pytest.mark.parametrize("qtype", list(RANDOM_BLOCK_SCALE_OFFSETS), ids=lambda q: q.name)
def test_dequantize_matches_gguf_reference_on_random_blocks(qtype):
    assert_matches_reference(random_blocks(qtype), qtype)
    assert_matches_reference(random_blocks(qtype, seed=1, scale=1e-6), qtype)  # float16 subnormal scales


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # gguf-py's, at e >= 253
def test_mxfp4_dequantizes_every_exponent_and_code_bit_for_bit():
    """Each exponent byte, the subnormal halves of e = 0 and 1 and the overflow of 253 .. 255 among them, with
    every nibble in each half of a block: gguf-py's float32s, bit for bit (infinities and signed zeros too)."""
    nibbles = np.arange(16, dtype=np.uint8)
    raw = np.empty((256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:, 1:] = nibbles | (nibbles[::-1] << 4)
    expected = quants.dequantize(raw, Q.MXFP4).astype(np.float32)
    actual = dequantize(torch.from_numpy(raw), Q.MXFP4, (256, 32))
    assert np.array_equal(actual.numpy().view(np.uint32), expected.view(np.uint32))


def test_mxfp4_from_hf_dequantizes_to_transformers_weights():
    """gpt-oss's Hugging Face blocks and scales, made ggml rows: dequantized, transformers' own float32 weights."""
    hf = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(0)
    experts, rows, groups = 2, 5, 3
    blocks = torch.from_numpy(rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8))
    # exponents at both ends too; not 255, where transformers' 0 · 2^128 is NaN (ggml's: 0 · 2^127)
    scales = torch.from_numpy(rng.integers(110, 140, (experts, rows, groups), dtype=np.uint8))
    scales[0, 0] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    ggml = mxfp4_from_hf(blocks, scales)
    assert ggml.dtype == torch.uint8 and ggml.shape == (experts, rows, groups * 17)
    ours = dequantize(ggml, Q.MXFP4, (experts, rows, groups * 32))
    theirs = hf.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # it gives [E, in, out]
    assert torch.equal(ours, theirs)


def test_f16_and_f32_pass_through_with_their_dtype():
    weights = random_weights()
    half = dequantize(torch.from_numpy(weights.astype(np.float16)), Q.F16, (ROWS, COLS))
    assert half.dtype == torch.float16 and torch.equal(half, torch.from_numpy(weights).half())
    assert torch.equal(dequantize(torch.from_numpy(weights), Q.F32, (ROWS, COLS)), torch.from_numpy(weights))


def test_bf16_stays_bfloat16():
    raw = quants.quantize(random_weights(), Q.BF16)
    assert dequantize(torch.from_numpy(raw), Q.BF16, (ROWS, COLS)).dtype == torch.bfloat16


def test_split_functions_expose_the_fields_int_kernels_repack():
    weights = random_weights()
    for qtype, split in ((Q.Q8_0, split_q8_0), (Q.Q4_0, split_q4_0), (Q.Q4_1, split_q4_1)):
        _, type_size = GGML_QUANT_SIZES[qtype]
        blocks = torch.from_numpy(quants.quantize(weights, qtype)).reshape(-1, type_size)
        fields = split(blocks)
        assert fields[0].dtype == torch.float16 and fields[0].shape == (blocks.shape[0], 1)
        assert fields[-1].shape[1] == (32 if qtype == Q.Q8_0 else 16)
    # Q4_1: weight = scale · nibble + min, low nibbles first.
    blocks = torch.from_numpy(quants.quantize(weights, Q.Q4_1)).reshape(-1, 20)
    scale, minimum, packed = split_q4_1(blocks)
    first = scale.float() * (packed[:, :1] & 0x0F).float() + minimum.float()
    expected = torch.from_numpy(quants.dequantize(quants.quantize(weights, Q.Q4_1), Q.Q4_1)).reshape(-1, 32)
    assert torch.equal(first[:, 0], expected[:, 0])


def test_supported_types_are_exactly_the_documented_ones():
    names = {q.name for q in SUPPORTED_TYPES}
    assert names == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                     "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"}
