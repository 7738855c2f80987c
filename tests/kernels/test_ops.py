"""The torch ops csrc/ops.cpp defines: their schemas (what each writes in place), their fake
implementations (output shapes for torch.compile), and the wrappers' refusal of inputs the C code
does not take."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmpipe.kernels.abi import ABI
from llmpipe.kernels import build

pytestmark = pytest.mark.skipif(build.library() is None, reason="needs AVX2 + FMA, a C compiler and ninja")

WRITES = {  # op → the arguments it writes in place
    "int4_linear": set(), "int8_linear": set(), "int4_linear_dot": set(), "int8_linear_dot": set(), "has_vnni": set(),
    "int4_dequantize": set(), "int8_dequantize": set(), "q5_0_linear": set(), "q5_0_linear_dot": set(),
    "q5_0_unpack": set(), "ggml_linear_dot": set(), "ggml_segments_dot": set(), "has_amx": set(), "greedy_argmax": set(),
    "small_batch_linear": set(), "paged_decode_attention": set(),
    "rope_heads": {"heads"}, "rope_write_decode_attention": {"heads", "kv_cache"}, "decode_step": {"x", "kv_pool", "kv_scales"},
    "gated_delta_step": {"state"}, "gated_delta_decode": {"conv_state", "ssm"},
}
N, K, GROUP = 48, 64, 32


def lowbit_args(rows: int, int4: bool) -> tuple:
    x = torch.randn(rows, K)
    scale, offset = torch.rand(N, K // GROUP), torch.randn(N, K // GROUP)
    if int4:
        return x, torch.randint(0, 256, (N, K // 2), dtype=torch.uint8), scale, offset, GROUP
    return x, torch.randint(-127, 128, (N, K), dtype=torch.int8), scale, GROUP


def q5_0_blocks() -> torch.Tensor:
    """GGUF Q5_0 blocks [N, K / 32 * 22] of random codes, each block's float16 scale 1/64."""
    blocks = torch.randint(0, 256, (N, K // 32, 22), dtype=torch.uint8)
    blocks[..., :2] = torch.tensor([1 / 64], dtype=torch.float16).view(torch.uint8)
    return blocks.flatten(1)


SEGMENT_BLOCKS = q5_0_blocks()  # the blocks ggml_segments_dot's table points at: alive as long as the module


def attention_args(batch: int = 2) -> dict:
    """A paged cache of 8 blocks of 4 tokens, 2 KV heads of 16, 6 query heads."""
    return dict(kv_cache=torch.randn(2, 8, 4, 2, 16), block_tables=torch.tensor([[3, 5, 1], [0, 2, 7]])[:batch],
                lens=torch.tensor([10, 7])[:batch])


INT8_SCALES = torch.rand(2, 8, 4, 2, 1).half()  # an int8 cache's float16 scales, a position and KV head each


def int8_attention_args() -> dict:
    return attention_args() | {"kv_cache": torch.randint(-127, 128, (2, 8, 4, 2, 16), dtype=torch.int8)}


def rope_args() -> tuple:
    a = attention_args()
    return (torch.randn(2, 6 + 2 * 2, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16), a["kv_cache"],
            torch.tensor([9, 30]), a["block_tables"], a["lens"], 6, 0.25, None)


def gated_delta_decode_args() -> tuple:
    """Two decode rows of a mixer with 2 key heads, 4 value heads of 8, kernel 4, in a pool of 3 states."""
    channels, value = 2 * 2 * 8 + 4 * 8, 4 * 8
    return (torch.randn(2, channels + value + 2 * 4), torch.randn(channels, 4), None, torch.randn(4), torch.randn(4),
            torch.ones(8), torch.randn(3, channels, 3), torch.randn(3, 4, 8, 8), torch.tensor([2, 0]), 2, 1e-6, False)


@pytest.mark.parametrize("name", WRITES)
def test_each_op_is_a_torch_op_whose_schema_marks_what_it_writes(name):
    schema = getattr(torch.ops.llmpipe, name).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == WRITES[name]


def test_the_integer_dot_ops_default_to_the_fastest_isa():
    fastest = {"int4_linear_dot": 1, "int8_linear_dot": 1, "int4_gemm_dot": 1, "int8_gemm_dot": 1,
               "ggml_linear_dot": 2, "ggml_segments_dot": 2}  # 2: AMX tiles where present
    for name, expected in fastest.items():
        (isa,) = [a for a in getattr(torch.ops.llmpipe, name).default._schema.arguments if a.name == "isa"]
        assert isa.default_value == expected


@pytest.mark.parametrize("op, args", [
    ("int4_linear", lowbit_args(3, int4=True)), ("int8_linear", lowbit_args(3, int4=False)),
    ("int4_linear_dot", lowbit_args(1, int4=True)), ("int8_linear_dot", lowbit_args(1, int4=False)),
    ("int4_linear_dot", lowbit_args(0, int4=True)), ("int8_linear", lowbit_args(9, int4=False)),  # none; two passes
    ("int4_dequantize", lowbit_args(1, int4=True)[1:]), ("int8_dequantize", lowbit_args(1, int4=False)[1:]),
    ("q5_0_linear", (torch.randn(3, K), q5_0_blocks())), ("q5_0_linear_dot", (torch.randn(2, K), q5_0_blocks())),
    ("q5_0_unpack", (q5_0_blocks(),)),
    ("ggml_linear_dot", (torch.randn(3, K), q5_0_blocks(), 6)),  # ggml type 6: Q5_0
    ("ggml_segments_dot", (torch.randn(3, K), torch.tensor([[6, N, SEGMENT_BLOCKS.data_ptr()]]), N)),
    ("greedy_argmax", (torch.randn(3, 1000),)),
    ("small_batch_linear", (torch.randn(3, 32), torch.randn(40, 32))),
    ("paged_decode_attention", (torch.randn(2, 6, 16), *attention_args().values(), 0.25, 4)),
    ("paged_decode_attention", (torch.randn(2, 6, 16), *int8_attention_args().values(), 0.25, 4, INT8_SCALES)),
    ("rope_heads", (torch.randn(3, 10, 16), torch.randn(3, 1, 16), torch.randn(3, 1, 16), 8)),
    ("rope_write_decode_attention", rope_args()),
    ("gated_delta_step", (*(torch.randn(2, 4, 8) for _ in range(3)), -torch.rand(2, 4), torch.rand(2, 4),
                          torch.randn(3, 4, 8, 8), torch.tensor([2, 0]))),
    ("gated_delta_decode", gated_delta_decode_args()),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_fake_implementations_match_the_kernels(op, args):
    """torch.library.opcheck: schema (no unmarked writes), fake tensor shapes, AOT dispatch."""
    torch.library.opcheck(getattr(torch.ops.llmpipe, op), args)


def test_the_decode_steps_fake_returns_nothing_and_leaves_shapes_alone():
    with FakeTensorMode():
        x, pool = torch.empty(3, 64), torch.empty(4, 2, 8, 4, 2, 16)
        out = torch.ops.llmpipe.decode_step(
            x, pool, None, torch.empty(4, ABI["LAYER_WORDS"], dtype=torch.int64), torch.empty(3, 1, 16), torch.empty(3, 1, 16),
            torch.empty(3, dtype=torch.int64), torch.empty(3, 2, dtype=torch.int64), torch.empty(3, dtype=torch.int64),
            [64, 4, 2, 16, 8, 4, 0], 1e-6, 0.25)
    assert out is None and x.shape == (3, 64)


def test_fake_outputs_have_the_kernels_shapes():
    with FakeTensorMode():
        y = torch.ops.llmpipe.int4_linear(*lowbit_args(5, int4=True))
        attn = torch.ops.llmpipe.rope_write_decode_attention(*rope_args())
    assert (y.shape, y.dtype) == ((5, N), torch.float32)
    assert (attn.shape, attn.dtype) == ((2, 6 * 16), torch.float32)


def refusal(op: str, *args) -> str:
    with pytest.raises(RuntimeError) as err:
        getattr(torch.ops.llmpipe, op)(*args)
    return str(err.value)


def test_a_wrong_dtype_is_refused_by_name():
    x, codes, scale, offset, group = lowbit_args(2, int4=True)
    assert "int4_linear: x must be Float, got Double" in refusal("int4_linear", x.double(), codes, scale, offset, group)
    message = refusal("int8_linear", x, codes, scale, group)  # int4 codes where int8 ones belong
    assert "int8_linear: codes must be Char, got Byte" in message


def test_a_non_contiguous_input_is_refused_by_name():
    x, codes, scale, offset, group = lowbit_args(2, int4=True)
    wide = torch.cat([codes, codes], dim=1)[:, ::2]
    assert "int4_linear: codes must be contiguous" in refusal("int4_linear", x, wide, scale, offset, group)
    heads, *rest = rope_args()
    strided = torch.randn(2, 16, 10).transpose(1, 2)
    assert "rope_write_decode_attention: heads must be contiguous" in refusal(
        "rope_write_decode_attention", strided, *rest)


def test_shapes_the_c_code_does_not_take_are_refused():
    x, codes, scale, offset, _ = lowbit_args(2, int4=True)
    # no rows: still checked
    assert "x must have size 64 in dimension 1" in refusal("q5_0_linear", torch.randn(0, 32), q5_0_blocks())
    assert "multiples of 32" in refusal("int4_linear", x, codes, scale, offset, 48)
    small_groups = torch.randn(48, K // 16)
    assert "multiples of 32" in refusal("int4_linear", x, codes, small_groups, small_groups, 16)  # INT8 only
    assert "scale must have size 48 in dimension 0" in refusal("int4_linear", x, codes, scale[:40], offset, GROUP)
    assert "bits must be 8 or 16, got 4" in refusal("int4_linear_dot", x, codes, scale, offset, GROUP, 4)
    assert "int4_dequantize: offset must have size 48 in dimension 0" in refusal(
        "int4_dequantize", codes, scale, offset[:40], GROUP)
    assert "int8_dequantize: scale must have size 4 in dimension 1" in refusal(
        "int8_dequantize", torch.zeros(N, K, dtype=torch.int8), scale, 16)
    assert "whole 22-byte Q5_0 blocks per row" in refusal("q5_0_linear", x, q5_0_blocks()[:, :30].contiguous())
    assert "q5_0_linear_dot: x must have size 64 in dimension 1" in refusal(
        "q5_0_linear_dot", torch.randn(2, 32), q5_0_blocks())
    assert "q5_0_unpack: blocks must be Byte, got Char" in refusal("q5_0_unpack", q5_0_blocks().view(torch.int8))
    assert "K must be a multiple of 16" in refusal("small_batch_linear", torch.randn(2, 24), torch.randn(8, 24))
    a = attention_args()
    assert "head dim must be a multiple of 8" in refusal(
        "paged_decode_attention", torch.randn(2, 6, 12), torch.randn(2, 8, 4, 2, 12), a["block_tables"], a["lens"],
        0.25, None)
    assert "lens must have size 2 in dimension 0" in refusal(
        "paged_decode_attention", torch.randn(2, 6, 16), a["kv_cache"], a["block_tables"], a["lens"][:1], 0.25, None)
    codes = int8_attention_args()["kv_cache"]
    assert "kv_cache must be Char, got Float" in refusal(
        "paged_decode_attention", torch.randn(2, 6, 16), a["kv_cache"], a["block_tables"], a["lens"], 0.25, None,
        INT8_SCALES)
    assert "kv_scales must be [2, blocks, block size, KV heads, 1]" in refusal(
        "paged_decode_attention", torch.randn(2, 6, 16), codes, a["block_tables"], a["lens"], 0.25, None,
        INT8_SCALES[:, :4].contiguous())
    tables = torch.randn(3, 1, 16)
    assert "rope_heads: rotated must be in [0, 10], got 11" in refusal("rope_heads", torch.randn(3, 10, 16), tables, tables, 11)
    assert "rope_heads: cos must hold 3 x 16 values" in refusal(
        "rope_heads", torch.randn(3, 10, 16), torch.randn(2, 1, 16), tables, 8)


def test_the_decode_step_refuses_a_descriptor_table_of_another_layout_or_out_of_range_indices():
    from llmpipe.models.llama.decode_step import TABLE_WORD

    width, rope_word = ABI["LAYER_WORDS"], ABI["LAYER_ROPE_WORD"]

    def step(descriptors: torch.Tensor, pool=torch.empty(0), scales=None) -> str:
        return refusal("decode_step", torch.randn(1, 64), pool, scales, descriptors, torch.randn(1, 1, 16),
                       torch.randn(1, 1, 16), torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, 1, dtype=torch.int64),
                       torch.ones(1, 1, dtype=torch.int64), [64, 4, 2, 16, 8, 4], 1e-6, 0.25)

    assert f"descriptors must have size {width} in dimension 1" in step(torch.zeros(2, 39, dtype=torch.int64))
    words = torch.zeros(2, width, dtype=torch.int64)
    words[1, TABLE_WORD] = 1  # a second block-table set, where one was passed
    assert "layer 1 names RoPE table 0 of 1 and block-table set 1 of 1" in step(words)
    words[1, TABLE_WORD], words[0, rope_word] = 0, 2  # RoPE table 2 of 1
    assert "layer 0 names RoPE table 2 of 1" in step(words)
    words[0, rope_word] = 0
    codes, scales = torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.float16)
    assert "kv_scales go with an int8 kv_pool" in step(words, codes)
    assert "kv_scales go with an int8 kv_pool" in step(words, torch.empty(0), scales)
    assert "kv_scales must be a float16 CPU tensor" in step(words, codes, scales.float())
    assert "layer 0 has no cache scales for its int8 cache" in step(words, codes, scales)
    words[:, -1] = 1
    assert "layer 0 has cache scales for a float32 cache" in step(words)
