"""Paged attention: K/V live in a pool of fixed-size blocks, addressed through block tables.

One forward carries a batch of decode tokens (one per sequence, first) and prefill chunks (a run
of new tokens of one sequence, possibly on top of a cached prefix). New K/V are written through a
flat slot mapping (slot = block id × block size + offset); reads gather each sequence's blocks.
Prefill and decode differ only in this metadata, built by the model runner.

Attention sinks (gpt-oss): a learned logit per query head joins each row's softmax denominator and
attends to nothing, so a head can put weight nowhere: out = softmax([scores, sink])[:-1] @ V, which is
the plain attention scaled by sigmoid(logsumexp(scores) − sink).

`reference_paged_attention` is the readable per-token definition the fast paths are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmpipe.layers import attention_kernel
from llmpipe.layers.rows import stack_rows
from llmpipe.quant.kv import QuantizedKV

KVLayer = torch.Tensor | QuantizedKV  # one layer's [2, blocks, block_size, kv_heads, head_dim] cache


@dataclass
class PrefillChunk:
    token_start: int  # slice of this forward's tokens belonging to the chunk
    token_end: int
    context_len: int  # tokens cached after this chunk (cached prefix + the chunk)
    block_table: torch.Tensor  # [blocks] block ids of the sequence


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] flat cache slot of each new token
    num_decodes: int  # the first num_decodes tokens are decodes: one query row each (a draft token adds a row)
    decode_block_tables: torch.Tensor | None  # [decodes, max blocks], padded with 0
    decode_context_lens: torch.Tensor | None  # [decodes] tokens cached including the new one
    prefills: list[PrefillChunk]
    decode_max_len: int = 0  # longest decode context (Python side, so no sync is needed to slice)
    decode_same_len: bool = True  # every decode context has decode_max_len tokens: no padding to mask


def write_kv(kv_cache: KVLayer, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, blocks, block_size, kv_heads, head_dim]; k, v: [tokens, kv_heads, head_dim]."""
    if isinstance(kv_cache, QuantizedKV):
        return kv_cache.write(k, v, slot_mapping)
    flat = kv_cache.flatten(1, 2)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def read_blocks(kv_cache: KVLayer, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K and V of blocks `block_ids`: [2, len(block_ids), block_size, kv_heads, head_dim]."""
    if isinstance(kv_cache, QuantizedKV):
        return kv_cache.read(block_ids, dtype)
    return kv_cache.index_select(1, block_ids)  # several times cheaper per call than advanced indexing on CPU


def gather_kv(
    kv_cache: KVLayer, block_table: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `length` K and V, each [length, kv_heads, head_dim]."""
    blocks = read_blocks(kv_cache, block_table, dtype).flatten(1, 2)
    return blocks[0, :length], blocks[1, :length]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [tokens, heads, D]; k, v: [tokens, kv_heads, D]; sinks: [heads] or None. Writes the new K/V,
    returns [tokens, heads × D]."""
    write_kv(kv_cache, k, v, meta.slot_mapping)
    rotation = kv_cache.rotation if isinstance(kv_cache, QuantizedKV) else None
    if rotation is not None:  # K/V are stored rotated (quant/kv.py): attend in that basis, rotate back
        out = _attend(q @ rotation.to(q.dtype), kv_cache, meta, scale, window, sinks)
        return (out.view(q.shape) @ rotation.T.to(q.dtype)).flatten(1)
    return _attend(q, kv_cache, meta, scale, window, sinks)


def _attend(q: torch.Tensor, kv_cache: KVLayer, meta: AttentionMetadata, scale: float, window: int | None,
            sinks: torch.Tensor | None) -> torch.Tensor:
    if not meta.prefills:
        return decode_attention(q, kv_cache, meta, scale, window, sinks)

    def parts():  # the decode rows first, then each prefill chunk's, one at a time
        if meta.num_decodes:
            yield slice(0, meta.num_decodes), decode_attention(q[: meta.num_decodes], kv_cache, meta, scale, window, sinks)
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_end)
            yield rows, prefill_attention(q[rows], kv_cache, chunk, scale, window, sinks)

    return stack_rows(q.shape[0], parts())


def decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence against its cached keys, batched over sequences of different lengths
    (padded to the longest; padding masked out). Two batched matmuls per step: PyTorch's CPU
    flash-attention kernel is several times slower for single queries. A float32 or int8 cache takes
    the C kernel instead (same math in one call, no gather; `attention_kernel`)."""
    if attention_kernel.usable(q, kv_cache):
        return attention_kernel.paged_decode_attention(
            q, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale, window, sinks
        )
    batch, length = q.shape[0], meta.decode_max_len
    kv_heads, head_dim = kv_cache.shape[-2:]
    blocks = read_blocks(kv_cache, meta.decode_block_tables.flatten(), q.dtype).view(2, batch, -1, kv_heads, head_dim)
    keys, values = blocks[0, :, :length], blocks[1, :, :length]  # [batch, L, kv_heads, D]
    grouped = q.view(batch, kv_heads, -1, head_dim)  # query heads sharing a KV head sit together
    # One bmm per KV head reads the gathered keys in place; a single 4-D matmul would copy them first.
    scores = torch.stack(
        [torch.bmm(grouped[:, h], keys[:, :, h].transpose(1, 2)) for h in range(kv_heads)], dim=1
    ) * scale  # [batch, kv_heads, group, L]
    window_cuts = window is not None and length > window
    if window_cuts or not meta.decode_same_len:
        lens = meta.decode_context_lens[:, None]
        key_pos = torch.arange(length, device=q.device)[None, :]
        masked = key_pos >= lens
        if window_cuts:
            masked |= key_pos < lens - window
        scores.masked_fill_(masked[:, None, None, :], float("-inf"))
    if sinks is not None:  # the sink's column joins the softmax, then is dropped
        sink_column = sinks.to(scores.dtype).view(1, kv_heads, -1, 1).expand(batch, -1, -1, 1)
        probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1, dtype=torch.float32)[..., :-1].to(values.dtype)
    else:
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
    out = torch.stack([torch.bmm(probs[:, h], values[:, :, h]) for h in range(kv_heads)], dim=1)
    return out.reshape(batch, -1)


def prefill_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, chunk: PrefillChunk, scale: float, window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A chunk of one sequence's new tokens attending causally to its cached prefix and themselves."""
    num_new = q.shape[0]
    start = chunk.context_len - num_new
    keys, values = gather_kv(kv_cache, chunk.block_table, chunk.context_len, q.dtype)
    mask = _causal_mask(start, num_new, chunk.context_len, window, q.device)
    if sinks is not None:
        return _prefill_with_sinks(q, keys, values, mask, scale, sinks)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None and num_new > 1,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(num_new, -1)


def _prefill_with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                        scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """prefill_attention with sinks: the plain attention and each row's logsumexp, the output scaled by
    sigmoid(logsumexp − sink)."""
    num_new, heads = q.shape[:2]
    group = heads // keys.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (keys, values))
    attend = _flash_with_lse if q.device.type == "cpu" else _math_with_lse
    out, lse = attend(q.transpose(0, 1), k, v, mask, scale)  # [heads, new, D], [heads, new]
    kept = torch.sigmoid(lse - sinks.float()[:, None])  # the weight not given to the sink
    return (out * kept.unsqueeze(-1).to(out.dtype)).transpose(0, 1).reshape(num_new, -1)


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash kernel, which returns each row's logsumexp beside its output (no [new, context]
    score matrix held). q, k, v: [heads, tokens, D]; mask as _causal_mask's (None: causal, or one token)."""
    bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=mask is None and q.shape[1] > 1,
        attn_mask=None if bias is None else bias.expand(1, q.shape[0], *bias.shape), scale=scale)
    return out[0], lse[0]


def _math_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """_flash_with_lse's results from the whole score matrix, in float32: the path off the CPU."""
    scores = (q.float() @ k.float().transpose(1, 2)) * scale
    if mask is None:
        mask = _causal_mask(0, q.shape[1], k.shape[1], None, q.device, always=True)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype), scores.logsumexp(-1)


def _causal_mask(start: int, num_new: int, end: int, window: int | None, device, always: bool = False) -> torch.Tensor | None:
    """Boolean [new, end] mask (True = may attend), or None where SDPA's own causal mask is exact
    (a chunk with no cached prefix and no window cutting in) unless `always`."""
    if start == 0 and (window is None or end <= window) and not always:
        return None
    query_pos = torch.arange(start, end, device=device)[:, None]
    key_pos = torch.arange(end, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask


def reference_paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: list[list[int]], positions: list[int],
    scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Definition, one token at a time: token i (at `positions[i]` of the sequence whose blocks are
    `block_tables[i]`) attends to that sequence's cached keys 0..positions[i] (last `window` only), each
    head's sink logit (if any) in the softmax's denominator."""
    heads, head_dim = q.shape[1:]
    kv_heads, block_size = kv_cache.shape[-2], kv_cache.shape[2]
    out = torch.empty(q.shape[0], heads * head_dim, dtype=q.dtype)
    for i, (table, pos) in enumerate(zip(block_tables, positions)):
        first = 0 if window is None else max(0, pos - window + 1)
        slots = [(table[p // block_size], p % block_size) for p in range(first, pos + 1)]
        keys = torch.stack([kv_cache[0, b, o] for b, o in slots])  # [L, kv_heads, D]
        values = torch.stack([kv_cache[1, b, o] for b, o in slots])
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            logits = (keys[:, kvh].float() @ q[i, h].float()) * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[h : h + 1].float()])
            weights = torch.softmax(logits, dim=0)[: len(slots)]
            out[i, h * head_dim : (h + 1) * head_dim] = (weights @ values[:, kvh].float()).to(q.dtype)
    return out
