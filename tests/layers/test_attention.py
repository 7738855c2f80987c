"""Fast paged attention (batched decode, in C or PyTorch, + SDPA prefill chunks) against the per-token reference."""

import random

import pytest
import torch

from llmpipe.layers import attention_kernel
from llmpipe.layers.attention import AttentionMetadata, PrefillChunk, paged_attention, reference_paged_attention

BLOCK, NUM_BLOCKS = 4, 64


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [(6, 2, 8), (9, 3, 64)], ids=["gqa-dim8", "smollm2-heads"])
@pytest.mark.parametrize("kernel", [True, False], ids=["C-decode", "PyTorch-decode"])
def test_mixed_decode_and_prefill_batch_matches_reference(window, heads, kernel, monkeypatch):
    HEADS, KV_HEADS, DIM = heads
    if kernel and not attention_kernel.ops.available():
        pytest.skip("no C compiler / AVX2: the PyTorch path is the only one")
    if not kernel:
        monkeypatch.setattr(attention_kernel, "usable", lambda q, kv_cache: False)
    rng = random.Random(0)
    torch.manual_seed(0)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    assert attention_kernel.usable(torch.zeros(1, HEADS, DIM), kv_cache) == kernel
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    # (tokens already cached, new tokens): three decodes, then a fresh prompt and a chunk on a cached prefix.
    shapes = [(9, 1), (2, 1), (17, 1), (0, 7), (6, 5)]
    tables, positions, slots, chunks, token_tables = [], [], [], [], []
    for cached, new in shapes:
        table = [free.pop() for _ in range(-(-(cached + new) // BLOCK))]
        tables.append(table)
        if new > 1:
            chunks.append(PrefillChunk(len(positions), len(positions) + new, cached + new, torch.tensor(table)))
        for pos in range(cached, cached + new):
            positions.append(pos)
            token_tables.append(table)
            slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
    decodes = [t for t, (_, new) in zip(tables, shapes) if new == 1]
    width = max(map(len, decodes))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=len(decodes),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in decodes]),
        decode_context_lens=torch.tensor([c + 1 for c, new in shapes if new == 1]),
        prefills=chunks,
        decode_max_len=max(c + 1 for c, new in shapes if new == 1),
        decode_same_len=False,
    )
    tokens = len(positions)
    q, k, v = torch.randn(tokens, HEADS, DIM), torch.randn(tokens, KV_HEADS, DIM), torch.randn(tokens, KV_HEADS, DIM)
    out = paged_attention(q, k, v, kv_cache, meta, scale=0.3, window=window)
    # The fast path wrote the new K/V; the reference reads the same cache one token at a time.
    expected = reference_paged_attention(q, kv_cache, token_tables, positions, scale=0.3, window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    flat = kv_cache.flatten(1, 2)
    torch.testing.assert_close(flat[0, torch.tensor(slots)], k)


@pytest.mark.parametrize("window", [None, 5])
def test_the_c_decode_attention_reads_an_int8_cache_as_its_dequantized_values(window):
    """The int8 cache (quant/kv.py) read in place, a block's run dequantized at a time: the reference on
    `QuantizedKV.read`'s values."""
    from llmpipe.quant.kv import QuantizedKV

    if not attention_kernel.ops.available():
        pytest.skip("no C compiler / AVX2: the PyTorch path is the only one")
    HEADS, KV_HEADS, DIM = 9, 3, 64
    torch.manual_seed(0)
    codes, scale, _ = QuantizedKV.storage("int8", (2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM), "cpu")
    cache = QuantizedKV(codes, scale, None, DIM)
    slots = torch.arange(NUM_BLOCKS * BLOCK)
    cache.write(torch.randn(len(slots), KV_HEADS, DIM), torch.randn(len(slots), KV_HEADS, DIM), slots)
    lens, tables = [9, 2, 17], [[5, 9, 1], [7, 0, 0], [2, 3, 4, 6, 8]]
    q = torch.randn(3, HEADS, DIM)
    assert attention_kernel.usable(q, cache)
    padded = torch.tensor([t + [0] * (5 - len(t)) for t in tables])
    out = attention_kernel.paged_decode_attention(q, cache, padded, torch.tensor(lens), 0.3, window)
    dequantized = cache.read(torch.arange(NUM_BLOCKS), torch.float32)
    expected = reference_paged_attention(q, dequantized, tables, [n - 1 for n in lens], scale=0.3, window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_kind", ["float32", "int8"])
@pytest.mark.parametrize("heads", [(4, 4, 8), (9, 3, 64), (4, 1, 256), (10, 2, 72), (16, 2, 40)],
                         ids=["mha-dim8", "smollm2", "gemma3-270m", "group5-dim72", "group8-dim40"])
@pytest.mark.parametrize("window", [None, 37])
def test_the_c_decode_attention_over_long_contexts_matches_reference(cache_kind, heads, window):
    """Long contexts through shuffled 16-position blocks (runs cut mid-block by windows), 1 to 8 query heads
    a KV head, head sizes leaving every tail of the kernel's strips, and batches that do not share out
    over the threads (their positions split in parts, merged by softmax maxima and sums)."""
    from llmpipe.quant.kv import QuantizedKV

    if not attention_kernel.ops.available():
        pytest.skip("no C compiler / AVX2: the PyTorch path is the only one")
    HEADS, KV_HEADS, DIM = heads
    block, num_blocks = 16, 80
    torch.manual_seed(1)
    rng = random.Random(1)
    lens = [300, 1, 8, 523]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens]
    k, v = torch.randn(num_blocks * block, KV_HEADS, DIM), torch.randn(num_blocks * block, KV_HEADS, DIM)
    slots = torch.arange(num_blocks * block)
    if cache_kind == "int8":
        codes, scale, _ = QuantizedKV.storage("int8", (2, num_blocks, block, KV_HEADS, DIM), "cpu")
        cache = QuantizedKV(codes, scale, None, DIM)
        cache.write(k, v, slots)
        values = cache.read(torch.arange(num_blocks), torch.float32)
    else:
        cache = values = torch.stack([k, v]).view(2, num_blocks, block, KV_HEADS, DIM)
    q = torch.randn(len(lens), HEADS, DIM)
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    expected = reference_paged_attention(q, values, tables, [n - 1 for n in lens], scale=0.2, window=window)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):  # 3: four sequences split in three parts each
            torch.set_num_threads(count)
            out = attention_kernel.paged_decode_attention(q, cache, padded, torch.tensor(lens), 0.2, window)
            torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window", [None, 5])
def test_fused_rope_write_decode_equals_rotary_then_paged_attention(window):
    """One C call for a decode-only step: the same cache writes (bit for bit: RoPE's products are
    not contracted into FMAs) and the same attention as apply_rotary + paged_attention."""
    from llmpipe.layers.rotary import RotaryEmbedding, apply_rotary

    if not attention_kernel.ops.available():
        pytest.skip("no C compiler / AVX2: the PyTorch path is the only one")
    HEADS, KV_HEADS, DIM = 9, 3, 64
    torch.manual_seed(0)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    rotary = RotaryEmbedding(DIM, 256, 10000.0, None)
    rotary.reset_tables()
    lens = [9, 2, 17]
    tables = [[5, 9, 1], [7, 0, 0], [2, 3, 4, 6, 8]]
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)]),
        num_decodes=3, decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=torch.tensor(lens), prefills=[], decode_max_len=max(lens), decode_same_len=False,
    )
    heads = torch.randn(3, HEADS + 2 * KV_HEADS, DIM)
    cos, sin = rotary.tables(torch.tensor(lens) - 1, torch.float32)
    assert attention_kernel.fused_decode_usable(heads, cos, kv_cache, meta)
    expected_cache = kv_cache.clone()
    qk = apply_rotary(heads[:, : HEADS + KV_HEADS], cos, sin)
    q, k = qk.split([HEADS, KV_HEADS], dim=1)
    expected = paged_attention(q, k, heads[:, HEADS + KV_HEADS :], expected_cache, meta, 0.125, window)
    got = attention_kernel.rope_write_decode_attention(heads.clone(), cos, sin, kv_cache, meta.slot_mapping,
                                                       meta.decode_block_tables, meta.decode_context_lens, HEADS, 0.125, window)
    assert torch.equal(kv_cache, expected_cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
