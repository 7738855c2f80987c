"""Which slice of each tensor a rank holds: split points, head assignment, quantized slices (no processes)."""

import pytest
import torch
from gguf import GGMLQuantizationType, quants

from llmpipe.config import ModelConfig
from llmpipe.distributed.sharding import plan_shards, shard_tensor, slice_columns, slice_rows, split
from llmpipe.errors import UnsupportedModelError
from llmpipe.quant.formats import Int8Weight, Q5_0Weight
from llmpipe.quant.rtn import quantize_int4, quantize_int8


def config(heads: int, kv_heads: int, **extra) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=64)
    return ModelConfig(**{**base, **extra})


def test_split_is_contiguous_even_and_cut_at_whole_units():
    assert split(112, 2) == [range(0, 56), range(56, 112)]
    assert split(112, 2, unit=32) == [range(0, 64), range(64, 112)]  # 3.5 groups: 2 + 1.5
    assert split(3, 2) == [range(0, 2), range(2, 3)]
    with pytest.raises(UnsupportedModelError):
        split(3, 4)


def test_ranks_take_whole_kv_groups_and_their_query_heads():
    # SmolLM2's shape: 9 query heads reading 3 KV heads, on 2 ranks → 2 + 1 KV groups.
    shards = plan_shards(config(9, 3, head_dim=64, hidden_size=576, intermediate_size=1536, vocab_size=49152), 2)
    assert [(s.q_heads, s.kv_heads) for s in shards] == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    assert [s.ffn for s in shards] == [range(0, 768), range(768, 1536)]
    assert [s.vocab for s in shards] == [range(0, 24576), range(24576, 49152)]


def test_fewer_kv_heads_than_ranks_replicates_them():
    shards = plan_shards(config(4, 1), 4)
    assert [s.kv_heads for s in shards] == [range(0, 1)] * 4
    assert [s.q_heads for s in shards] == [range(i, i + 1) for i in range(4)]
    shards = plan_shards(config(8, 2), 4)
    assert [s.kv_heads.start for s in shards] == [0, 0, 1, 1]  # query heads 0-3 read KV head 0, 4-7 KV head 1
    with pytest.raises(UnsupportedModelError, match="KV heads"):
        plan_shards(config(6, 2), 3)  # 2 KV heads cannot be replicated evenly over 3 ranks


def test_int4_groups_straddling_a_head_split_are_refused():
    plan = {"model.layers.0.self_attn.o_proj.weight": ("int4", 64)}
    with pytest.raises(UnsupportedModelError, match="group of 64"):
        plan_shards(config(4, 2), 2, plan)  # rank 1's o_proj inputs start at column 32
    plan_shards(config(4, 2), 2, {"model.layers.0.self_attn.o_proj.weight": ("int4", 32)})


@pytest.mark.parametrize(("quantize", "inputs"), [
    (lambda w: quantize_int4(w, 32), 112),  # the last group of 32 is partial
    (quantize_int8, 112),
    (lambda w: Int8Weight(*_grouped_int8(w)), 128),  # GGUF Q8_0: whole groups of 32
    (lambda w: Q5_0Weight(_q5_0_blocks(w)), 128),  # GGUF Q5_0 kept as the file's blocks
], ids=["int4-g32", "int8-row", "int8-g32", "q5_0"])
def test_quantized_column_slices_dequantize_to_the_full_weights_columns(quantize, inputs):
    torch.manual_seed(0)
    full = quantize(torch.randn(8, inputs))
    for cols in split(inputs, 2, unit=32):
        part = slice_columns(full, cols, "w")
        torch.testing.assert_close(part.dequantize(), full.dequantize()[:, cols.start : cols.stop], rtol=0, atol=0)


def _q5_0_blocks(w: torch.Tensor) -> torch.Tensor:
    raw = quants.quantize(w.numpy(), GGMLQuantizationType.Q5_0)
    return torch.from_numpy(raw).reshape(w.shape[0], -1).contiguous()


def test_q5_0_row_slices_and_block_splitting_columns():
    torch.manual_seed(0)
    full = Q5_0Weight(_q5_0_blocks(torch.randn(8, 128)))
    torch.testing.assert_close(slice_rows(full, range(3, 7)).dequantize(), full.dequantize()[3:7], rtol=0, atol=0)
    with pytest.raises(UnsupportedModelError, match="split a Q5_0 block"):
        slice_columns(full, range(16, 128), "w")


def _grouped_int8(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, int]:
    groups = torch.nn.functional.pad(w, (0, -w.shape[1] % group)).unflatten(1, (-1, group))
    scale = groups.abs().amax(-1) / 127
    q = (groups / scale[..., None]).round().flatten(1)[:, : w.shape[1]]
    return q.to(torch.int8), scale, group


def test_float_row_parallel_weight_is_quantized_whole_then_sliced():
    """int8's per-row scale comes from the whole row, so both ranks' pieces match the single-process weight."""
    torch.manual_seed(0)
    w = torch.randn(64, 112)
    shards = plan_shards(config(4, 2), 2)
    pieces = [shard_tensor("model.layers.0.mlp.down_proj.weight", w, s, ("int8", None)) for s in shards]
    torch.testing.assert_close(torch.cat([p.dequantize() for p in pieces], dim=1), quantize_int8(w).dequantize(), rtol=0, atol=0)
