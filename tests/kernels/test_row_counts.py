"""Every kernel entry point at its empty and boundary batch sizes against plain PyTorch: 0 rows (an
engine step whose prefill chunks end no prompt has no logits row), 1, the row kernels' MAX_ROWS and
MAX_ROWS + 1 (a second pass), and for the layers KERNEL_MAX_BATCH and one past it (the GEMM)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmpipe.kernels.abi import ABI
from llmpipe.kernels import build
from llmpipe.layers import attention_kernel
from llmpipe.layers.attention import AttentionMetadata, paged_attention, reference_paged_attention
from llmpipe.layers.linear import SPLIT_MAX_ROWS, linear
from llmpipe.layers.rotary import RotaryEmbedding, apply_rotary
from llmpipe.layers.sampler import argmax_rows
from llmpipe.kernels import ops
from llmpipe.quant.formats import Int8Weight, Q5_0Weight
from llmpipe.quant.linear import KERNEL_MAX_BATCH, Int4Linear, Int8Linear, Q5_0Linear, decode_numerics

MAX = ops.MAX_ROWS
ROWS = (0, 1, MAX, MAX + 1)
PANEL_ROWS = ROWS + (4, 5, 2 * MAX + 1)  # the panels' tiles of 4 rows and the 1-3 left over
LAYER_ROWS = ROWS + (KERNEL_MAX_BATCH, KERNEL_MAX_BATCH + 1)
N, K, GROUP = 44, 96, 32  # 44 output rows: the last panel of 8 half full; K: three chunks
needs_library = pytest.mark.skipif(build.library() is None, reason="needs AVX2 + FMA, a C compiler and ninja")


def assert_close(got: torch.Tensor, want: torch.Tensor, rows: int, tolerance: float = 1e-5) -> None:
    assert got.shape == want.shape == (rows, want.shape[1]) and got.dtype == torch.float32, (rows, got.shape)
    if rows:
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() < tolerance, rows


def int4_weight() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes [N, K / 2], scale, offset, the codes unpacked [N, K]) as Int4Linear packs them."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    chunks = q.view(N, -1, 2, ops.CHUNK // 2)
    packed = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).flatten(1).contiguous()
    return packed, torch.rand(N, K // GROUP) / 10, torch.randn(N, K // GROUP) / 10, q


def int4_dense(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double().repeat_interleave(GROUP, 1) + offset.double().repeat_interleave(GROUP, 1)


def int8_weight(group: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N, -(-K // group)) / 100


def int8_dense(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return q.double() * scale.double().repeat_interleave(group, 1)[:, :K]


def q5_0_blocks() -> torch.Tensor:
    torch.manual_seed(2)
    blocks = torch.randint(0, 256, (N, K // 32, 22), dtype=torch.uint8)
    blocks[..., :2] = torch.tensor([1 / 64], dtype=torch.float16).view(torch.uint8)
    return blocks.flatten(1)


def rows_of(rows: int) -> torch.Tensor:
    torch.manual_seed(100 + rows)
    return torch.randn(rows, K)


# ---- the C ops ------------------------------------------------------------------------------


@needs_library
@pytest.mark.parametrize("rows", ROWS)
def test_the_float_activation_row_kernels(rows):
    x = rows_of(rows)
    codes, scale, offset, q = int4_weight()
    assert_close(ops.int4_linear(x, codes, scale, offset, GROUP), x.double() @ int4_dense(q, scale, offset).T, rows)
    for group in (K, 32, 16):  # per channel, Q8_0, Q6_K's half chunks
        q8, s8 = int8_weight(group)
        assert_close(ops.int8_linear(x, q8, s8, group), x.double() @ int8_dense(q8, s8, group).T, rows)
    five = Q5_0Weight(q5_0_blocks()).to_int8()  # PyTorch's unpacking of the blocks
    assert_close(ops.q5_0_linear(x, q5_0_blocks()), x.double() @ int8_dense(five.q, five.scale, 32).T, rows)


@needs_library
@pytest.mark.parametrize("bits", ops.ACTIVATION_BITS)
@pytest.mark.parametrize("rows", ROWS)
def test_the_integer_dot_row_kernels(rows, bits):
    x = rows_of(rows)
    codes, scale, offset, q = int4_weight()
    want = ops.reference_dot_linear(x, q, scale, offset, GROUP, bits)
    assert_close(ops.int4_linear_dot(x, codes, scale, offset, GROUP, bits), want, rows, 1e-6)
    for group in (K, 32, 16):
        q8, s8 = int8_weight(group)
        want = ops.reference_dot_linear(x, q8, s8, None, group, bits)
        assert_close(ops.int8_linear_dot(x, q8, s8, group, bits), want, rows, 1e-6)
    five = Q5_0Weight(q5_0_blocks()).to_int8()
    want = ops.reference_dot_linear(x, five.q, five.scale, None, 32, bits)
    assert_close(ops.q5_0_linear_dot(x, q5_0_blocks(), bits), want, rows, 1e-6)


@needs_library
@pytest.mark.parametrize("bits", ops.ACTIVATION_BITS)
@pytest.mark.parametrize("rows", PANEL_ROWS)
def test_the_panel_kernels(rows, bits):
    x = rows_of(rows)
    codes, scale, offset, q = int4_weight()
    want = ops.reference_dot_linear(x, q, scale, offset, GROUP, bits)
    assert_close(ops.int4_gemm_dot(x, ops.int4_panels(codes, scale, offset, GROUP), N, bits), want, rows, 1e-6)
    for group in (K, 32, 16):
        q8, s8 = int8_weight(group)
        want = ops.reference_dot_linear(x, q8, s8, None, group, bits)
        assert_close(ops.int8_gemm_dot(x, ops.int8_panels(q8, s8, group), N, bits), want, rows, 1e-6)


@needs_library
@pytest.mark.parametrize("rows", ROWS + (2,))
def test_the_small_batch_kernel(rows):
    x, weight = rows_of(rows), torch.randn(N, K)
    assert_close(torch.ops.llmpipe.small_batch_linear(x, weight), x.double() @ weight.double().T, rows)


@pytest.mark.parametrize("rows", ROWS)
def test_greedy_argmax(rows):
    torch.manual_seed(rows)
    logits = torch.randn(rows, 1000)
    got = argmax_rows(logits)  # the C kernel where it is built
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))
    if build.library() is not None:
        assert torch.equal(torch.ops.llmpipe.greedy_argmax(logits), logits.argmax(dim=-1))


BLOCK, HEADS, KV_HEADS, DIM = 4, 6, 2, 16


def decode_batch(batch: int) -> tuple[torch.Tensor, list[list[int]], list[int]]:
    """A cache of 16 blocks of 4 and `batch` sequences whose lengths end on, and one past, a block boundary."""
    torch.manual_seed(batch)
    tables = [[(3 * s + b) % 16 for b in range(3)] for s in range(batch)]
    return torch.randn(2, 16, BLOCK, KV_HEADS, DIM), tables, [BLOCK * (1 + s % 2) + s % 3 for s in range(batch)]


@needs_library
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("batch", ROWS)
def test_paged_decode_attention(batch, window):
    kv_cache, tables, lens = decode_batch(batch)
    q = torch.randn(batch, HEADS, DIM)
    got = attention_kernel.paged_decode_attention(
        q, kv_cache, torch.tensor(tables, dtype=torch.long).view(batch, 3), torch.tensor(lens, dtype=torch.long), 0.25,
        window)
    want = reference_paged_attention(q, kv_cache, tables, [n - 1 for n in lens], 0.25, window)
    assert_close(got, want, batch)


@needs_library
@pytest.mark.parametrize("batch", ROWS)
def test_the_fused_rope_write_decode_attention(batch):
    """Against apply_rotary + paged_attention's writes and attention (an empty batch writes nothing)."""
    kv_cache, tables, lens = decode_batch(batch)
    rotary = RotaryEmbedding(DIM, 64, 10000.0, None)
    rotary.reset_tables()
    table_t = torch.tensor(tables, dtype=torch.long).view(batch, 3)
    slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)], dtype=torch.long)
    meta = AttentionMetadata(slots, batch, table_t, torch.tensor(lens, dtype=torch.long), [], max(lens, default=0), False)
    heads = torch.randn(batch, HEADS + 2 * KV_HEADS, DIM)
    cos, sin = rotary.tables(torch.tensor(lens, dtype=torch.long) - 1, torch.float32)
    expected_cache = kv_cache.clone()
    q, k = apply_rotary(heads[:, : HEADS + KV_HEADS], cos, sin).split([HEADS, KV_HEADS], dim=1)
    v = heads[:, HEADS + KV_HEADS :]
    want = paged_attention(q, k, v, expected_cache, meta, 0.25) if batch else torch.empty(0, HEADS * DIM)
    got = attention_kernel.rope_write_decode_attention(heads.clone(), cos, sin, kv_cache, slots, table_t,
                                                       meta.decode_context_lens, HEADS, 0.25, None)
    assert torch.equal(kv_cache, expected_cache)
    assert_close(got, want, batch)


@needs_library
def test_the_decode_step_of_an_empty_batch_changes_nothing():
    x, pool = torch.empty(0, 64), torch.randn(4, 2, 8, 4, 2, 16)
    before = pool.clone()
    out = torch.ops.llmpipe.decode_step(
        x, pool, None, torch.zeros(2, ABI["LAYER_WORDS"], dtype=torch.int64), torch.empty(1, 0, 16), torch.empty(1, 0, 16),
        torch.empty(1, 0, dtype=torch.int64), torch.empty(1, 0, 1, dtype=torch.int64), torch.empty(1, 0, dtype=torch.int64),
        [64, 4, 2, 16, 8, 4], 1e-6, 0.25)
    assert out is None and x.shape == (0, 64) and torch.equal(pool, before)


# ---- the layers that dispatch to them -----------------------------------------------------------


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("rows", ROWS + (SPLIT_MAX_ROWS, SPLIT_MAX_ROWS + 1))
def test_the_float_linear(rows, splits):
    x, weight, bias = rows_of(rows), torch.randn(N, K), torch.randn(N)
    assert_close(linear(x, weight, bias, splits), F.linear(x.double(), weight.double(), bias.double()), rows)


def quantized_layers() -> dict[str, torch.nn.Module]:
    torch.manual_seed(3)
    int4 = Int4Linear(K, N, bias=True, group_size=GROUP)
    int4.load_shard(None, torch.randn(N, K))
    int8 = Int8Linear(K, N)
    int8.load_shard(None, torch.randn(N, K))
    q6_k = Int8Linear(K, N, group_size=16)
    q6_k.load_shard(None, Int8Weight(*int8_weight(16), 16))
    q5_0 = Q5_0Linear(K, N)
    q5_0.load_shard(None, Q5_0Weight(q5_0_blocks()))
    for layer in (int4, int8, q6_k, q5_0):
        if layer.bias is not None:
            layer.bias.data = torch.randn(N)
    return {"int4": int4, "int8": int8, "q6_k": q6_k, "q5_0": q5_0}


LAYERS = quantized_layers()


@pytest.mark.parametrize("float_copy", [False, True], ids=["codes", "float copy"])
@pytest.mark.parametrize("bits", [None, 8, 16], ids=["float activations", "8-bit blocks", "16-bit blocks"])
@pytest.mark.parametrize("kind", LAYERS)
def test_the_quantized_layers_take_every_row_count(kind, bits, float_copy):
    """0 rows to past KERNEL_MAX_BATCH, inside an engine step (decode_numerics) and out: the dequantized
    weight's product, to the activations' rounding."""
    layer = LAYERS[kind]
    layer.activation_bits, layer.float_weight = bits, None
    if float_copy:
        layer.keep_float_copy()
    weight = layer.dequantize().double()
    bias = 0 if layer.bias is None else layer.bias.double()
    tolerance = {None: 1e-5, 16: 1e-4, 8: 2e-2}[bits]
    for numerics in (False, True):
        for rows in LAYER_ROWS:
            x = rows_of(rows)
            with decode_numerics(numerics):
                got = layer(x)
            assert_close(got, x.double() @ weight.T + bias, rows, tolerance)
