"""YaRN RoPE tables against transformers' Llama rotary embedding (cos and sin scaled by the attention factor)."""

import pytest
import torch
import transformers

from llmpipe.layers.rotary import RotaryEmbedding

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("extra", [
    {},  # attention factor 0.1 ln(factor) + 1
    {"attention_factor": 1.0},
    {"mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},  # DeepSeek's mscale ratio
    {"truncate": False},
])
def test_yarn_tables_match_transformers_llama(extra):
    params = {**YARN, **extra, "rope_theta": 50000.0}
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=256, rope_parameters=params
    )
    positions = torch.arange(256)
    cos, sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)(
        torch.zeros(1, dtype=torch.float32), positions[None]
    )
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    ours = RotaryEmbedding(32, 256, 50000.0, scaling)
    our_cos, our_sin = ours.tables(positions, torch.float32)
    torch.testing.assert_close(our_cos[:, 0], cos[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(our_sin[:, 0], sin[0], atol=2e-5, rtol=0)


def test_tables_grow_with_the_positions_and_hold_the_rows_a_whole_table_would():
    """A 128K-position model whose requests reach position 9,000 holds 16,384 rows, not 131,072; the rows
    are those of a table computed at once for every position (each row is a function of its position)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    rope = RotaryEmbedding(64, 131072, 500000.0, scaling)
    assert rope.cos.shape == (0, 64)
    rope.tables(torch.tensor([0, 5]), torch.float32)
    assert rope.cos.shape[0] == RotaryEmbedding.MIN_ROWS
    cos, sin = rope.tables(torch.tensor([9000, 3]), torch.float32)
    assert rope.cos.shape[0] == 16384
    whole = RotaryEmbedding(64, 16384, 500000.0, scaling)
    whole.tables(torch.tensor([16383]), torch.float32)
    assert torch.equal(rope.cos, whole.cos) and torch.equal(rope.sin, whole.sin)
    assert torch.equal(cos[:, 0], whole.cos[[9000, 3]]) and torch.equal(sin[:, 0], whole.sin[[9000, 3]])


def test_tables_stop_at_max_positions():
    rope = RotaryEmbedding(16, 5000, 10000.0, None)
    rope.tables(torch.tensor([4999]), torch.float32)
    assert rope.cos.shape[0] == 5000
    with pytest.raises(IndexError):
        rope.tables(torch.tensor([5000]), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,head_dim", [(0, 64), (1, 64), (5, 24), (300, 128)])
def test_rotate_heads_in_place_equals_apply_rotary(rows, head_dim, dtype):
    """The C kernel (float32; D / 2 a multiple of 8 or not) and the PyTorch fallback (bfloat16): the first
    `count` heads exactly as apply_rotary turns them, the rest (v) untouched."""
    from llmpipe.kernels import ops
    from llmpipe.layers.rotary import apply_rotary, rotate_heads_

    if dtype == torch.float32 and not ops.available():
        pytest.skip("no C compiler: the PyTorch path is the only one")
    torch.manual_seed(rows)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    cos, sin = rope.tables(torch.randint(0, 4096, (rows,)), dtype)
    heads = torch.randn(rows, 7, head_dim).to(dtype)
    got = rotate_heads_(heads.clone(), cos, sin, 5)
    assert torch.equal(got[:, :5], apply_rotary(heads[:, :5], cos, sin))
    assert torch.equal(got[:, 5:], heads[:, 5:])
