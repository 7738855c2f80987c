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
    if kernel and attention_kernel._library() is None:
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
