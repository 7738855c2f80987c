"""DeepSeek V4 attention: a sliding window of one shared K=V head, plus compressed entries (CSA / HCA).

Per layer: a low-rank query (q_a → RMSNorm → q_b → unweighted RMSNorm per head), one K=V vector per
token (kv_proj → RMSNorm), RoPE on the last rope_head_dim channels (interleaved pairs; the compressed
layers use the YaRN-scaled "compress" RoPE), one softmax over the window's keys, the compressed entries
the query may see and a learned per-head sink, the RoPE undone on the output at the query's position
(values carry it, K = V), and a grouped low-rank output projection.

Cache (cache.py): each token's row in the layer's window store holds its K=V vector
and, on compressed layers, its compressor projections, kept while a query or an open window still reads
them; closed windows become rows of the entry store, one per `ratio` tokens (the CSA row also holds the
indexer key). An entry is visible to a query once all its tokens are at or before the query.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.models.deepseek_v4.config import CSA, WINDOW
from llmpipe.kv_cache.kinds import CompressedMetadata
from llmpipe.models.deepseek_v4.cache import EntryStore, WindowStore, WindowStoreMetadata, store_specs
from llmpipe.models.deepseek_v4.compressor import Compressor, Indexer
from llmpipe.layers.linear import Linear
from llmpipe.layers.norm import Float32RMSNorm, unweighted_rms_norm
from llmpipe.layers.rotary import InterleavedRotaryEmbedding, apply_interleaved_rotary

Ropes = tuple[InterleavedRotaryEmbedding, InterleavedRotaryEmbedding]  # (main, compress)
LayerCache = tuple[torch.Tensor, torch.Tensor | None]  # window store, entry store: [blocks, block_size, width]
LayerMeta = tuple[WindowStoreMetadata, CompressedMetadata | None]  # their groups' metadata
QUERY_BLOCK = 256  # queries attended together within a prefill chunk


@dataclass
class Segment:
    """One sequence's new tokens in this forward: batch rows [row, row + n), positions [start, start + n)."""

    row: int
    start: int
    n: int
    window_blocks: torch.Tensor  # window store blocks from the first one still held
    window_base: int  # position of window_blocks[0]'s first row
    entry_blocks: torch.Tensor | None

    def split(self, size: int) -> list["Segment"]:
        """Runs of at most `size` queries (a long prefill chunk attends run by run: each run's keys are
        only its own window, so the work grows linearly with the chunk, not quadratically)."""
        return [replace(self, row=self.row + i, start=self.start + i, n=min(size, self.n - i))
                for i in range(0, self.n, size)]


class DeepseekV4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        v4 = cfg.extra
        self.kind = v4.layer_types[layer]
        self.heads, self.head_dim, self.window = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        self.o_groups, self.eps = v4.o_groups, cfg.rms_norm_eps
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.q_a_proj = Linear(hidden, v4.q_lora_rank, bias=False)
        self.q_a_norm = Float32RMSNorm(v4.q_lora_rank, eps)
        self.q_b_proj = Linear(v4.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.kv_proj = Linear(hidden, self.head_dim, bias=False)
        self.kv_norm = Float32RMSNorm(self.head_dim, eps)
        self.o_a_proj = nn.Linear(self.heads * self.head_dim // v4.o_groups, v4.o_groups * v4.o_lora_rank, bias=False)
        self.o_b_proj = Linear(v4.o_groups * v4.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(self.heads))
        self.stores = store_specs(cfg, layer)
        self.compressor: Compressor | None = None
        if self.kind != WINDOW:
            ratio = v4.compress_rates[self.kind]
            self.compressor = Compressor(hidden, self.head_dim, ratio, overlap=self.kind == CSA, eps=eps)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(
                    hidden, v4.q_lora_rank, v4.index_n_heads, v4.index_head_dim, ratio, v4.index_topk, eps
                )

    def kv_cache_spec(self) -> tuple[WindowStore, EntryStore | None]:
        """The layer's window store and, on CSA / HCA layers, its entry store (cache.py)."""
        return self.stores

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ropes: Ropes, cache: LayerCache, meta: LayerMeta
    ) -> torch.Tensor:
        rope = ropes[0] if self.compressor is None else ropes[1]
        cos, sin = rope.tables(positions)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(x.shape[0], self.heads, self.head_dim)
        q = unweighted_rms_norm(q, self.eps)
        q = apply_interleaved_rotary(q, cos, sin)
        kv = apply_interleaved_rotary(self.kv_norm(self.kv_proj(x)).unsqueeze(1), cos, sin).squeeze(1)
        window_store, entry_store = cache
        _write_rows(window_store, meta[0].slot_mapping, self._token_rows(x, kv))
        out = torch.empty_like(q)
        num_decodes = meta[0].num_decodes
        if self.compressor is not None:  # entries first: a draft row may read one its predecessor's token closed
            for i, position in enumerate(meta[0].decode_positions):
                if (position + 1) % self.compressor.ratio == 0:
                    seg = decode_segment(meta, i)
                    window_rows = _read_rows(window_store, seg.window_blocks, seg.start + 1 - seg.window_base)
                    self._entries(seg, window_rows, entry_store, ropes[1])
        if num_decodes:
            rows = slice(0, num_decodes)
            out[rows] = self._attend_decodes(q[rows], meta, positions[rows], window_store, entry_store,
                                             x[rows], q_residual[rows], cos[rows], sin[rows])
        for seg in chunk_segments(meta):
            window_rows = _read_rows(window_store, seg.window_blocks, seg.start + seg.n - seg.window_base)
            if self.compressor is not None:
                self._entries(seg, window_rows, entry_store, ropes[1])
            for part in seg.split(QUERY_BLOCK):
                rows = slice(part.row, part.row + part.n)
                out[rows] = self._attend(q[rows], part, window_rows[:, : self.head_dim], entry_store,
                                         x[rows], q_residual[rows], cos[rows], sin[rows])
        out = apply_interleaved_rotary(out, cos, -sin)  # values carry RoPE (K = V): rotate it back out
        grouped = out.view(x.shape[0], self.o_groups, -1).transpose(0, 1)
        weight = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])
        return self.o_b_proj(torch.bmm(grouped, weight.transpose(1, 2)).transpose(0, 1).flatten(1))

    # ---- cache rows --------------------------------------------------------------------------

    def _token_rows(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Each new token's window row: K=V, then the compressor's and the indexer's projections."""
        if self.compressor is None:
            return kv
        parts = [kv, self.compressor.project(x)]
        if self.kind == CSA:
            parts.append(self.compressor.indexer.project(x))
        return torch.cat(parts, dim=-1)

    def _entries(self, seg: Segment, window_rows: torch.Tensor, entry_store: torch.Tensor, rope) -> None:
        """Pool the windows that close within the segment into entry rows."""
        c = self.compressor
        r, end = c.ratio, seg.start + seg.n
        first, last = -(-(seg.start + 1) // r) - 1, end // r  # windows closing at positions start..end-1
        if last > first:
            previous = c.overlap and first > 0
            lo = (first - previous) * r - seg.window_base
            rows = window_rows[lo : last * r - seg.window_base, self.head_dim :].unflatten(0, (-1, r))
            new = c.pool(rows[..., : c.row_width], first, previous, rope)
            if self.kind == CSA:
                new = torch.cat([new, c.indexer.pool(rows[..., c.row_width :], first, previous, rope)], dim=-1)
            slots = _slots(seg.entry_blocks, torch.arange(first, last, device=new.device), entry_store.shape[1])
            _write_rows(entry_store, slots, new)

    # ---- attention ---------------------------------------------------------------------------

    def _attend(self, q, seg: Segment, window_kv, entry_store, x, q_residual, cos, sin) -> torch.Tensor:
        """One sequence's queries q [n, heads, D] at positions start..start+n-1: keys are the window's
        rows of window_kv (shared by the queries, masked per query) and the entries each may see."""
        query_pos = torch.arange(seg.start, seg.start + seg.n, device=q.device)[:, None]
        first_key = max(seg.window_base, seg.start - self.window + 1)
        keys = window_kv[first_key - seg.window_base : seg.start + seg.n - seg.window_base]
        key_pos = torch.arange(first_key, seg.start + seg.n, device=q.device)[None, :]
        parts = [(keys, (key_pos <= query_pos) & (key_pos > query_pos - self.window))]
        num_entries = (seg.start + seg.n) // self.compressor.ratio if self.compressor else 0
        if num_entries:
            visible = torch.arange(num_entries, device=q.device)[None, :] < (query_pos + 1) // self.compressor.ratio
            parts.append(self._entry_part(entry_store, seg.entry_blocks, num_entries, visible, x, q_residual, cos, sin))
        return self._mix(q, parts)

    def _attend_decodes(self, q, meta: LayerMeta, positions: torch.Tensor, window_store, entry_store,
                        x, q_residual, cos, sin) -> torch.Tensor:
        """Decode rows q [B, heads, D], one query each, batched: each row's keys are its own sequence's
        (gathered from its block table, padding masked)."""
        window, entry = meta
        lens = window.decode_context_lens[:, None]  # rows held from the first block on, the new one included
        keys = _read_rows(window_store[..., : self.head_dim], window.decode_block_tables, window.decode_max_len)
        held = torch.arange(keys.shape[1], device=q.device)[None, :]
        parts = [(keys, (held < lens) & (held >= lens - self.window))]
        num_entries = (max(window.decode_positions) + 1) // self.compressor.ratio if self.compressor else 0
        if num_entries:
            visible = torch.arange(num_entries, device=q.device)[None, :] < (positions[:, None] + 1) // self.compressor.ratio
            parts.append(self._entry_part(entry_store, entry.decode_block_tables, num_entries, visible,
                                          x, q_residual, cos, sin))
        return self._mix(q, parts)

    def _entry_part(self, entry_store, blocks, count, visible, x, q_residual, cos, sin):
        """The entries the queries attend to and which each may use: every visible one (HCA), or the
        indexer's top-k of them (CSA, sparse). blocks: one block table [nb], or one per query [n, nb]."""
        if self.kind != CSA:
            return _read_rows(entry_store, blocks, count), visible
        index_keys = _read_rows(entry_store[..., self.head_dim :], blocks, count)
        chosen, valid = self.compressor.indexer.select(x, q_residual, cos, sin, index_keys, visible)
        return _gather_rows(entry_store[..., : self.head_dim], blocks, chosen), valid

    def _mix(self, q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One softmax over every part's keys and the per-head sink; K = V. A part's keys are [K, D]
        (shared by the queries) or [n, K, D] (per query), with allowed [n, K]."""
        scale = self.head_dim**-0.5
        scores = [((q @ keys.transpose(-1, -2)) * scale).masked_fill(~allowed[:, None, :], float("-inf"))
                  for keys, allowed in parts]
        sinks = self.sinks.to(q.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
        logits = torch.cat([*scores, sinks], dim=-1)
        probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1).to(q.dtype)
        out, start = 0, 0
        for (keys, _), part in zip(parts, scores):
            out = out + probs[..., start : start + part.shape[-1]] @ keys
            start += part.shape[-1]
        return out


def decode_segment(meta: LayerMeta, i: int) -> Segment:
    """Decode row i as a one-token segment."""
    window, entry = meta
    position, length = window.decode_positions[i], window.decode_lens[i]
    entry_blocks = None if entry is None else entry.decode_block_tables[i]
    return Segment(i, position, 1, window.decode_block_tables[i], position + 1 - length, entry_blocks)


def chunk_segments(meta: LayerMeta) -> list[Segment]:
    """The batch's prefill chunks as segments."""
    window, entry = meta
    out = []
    for k, (chunk, start) in enumerate(zip(window.prefills, window.chunk_starts)):
        n = chunk.token_end - chunk.token_start
        entry_blocks = None if entry is None else entry.prefill_block_tables[k]
        base = start + n - chunk.context_len
        out.append(Segment(chunk.token_start, start, n, chunk.block_table, base, entry_blocks))
    return out


def _write_rows(store: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """store: [blocks, block_size, width] (a strided view of the pool); slots: flat block × block_size + row."""
    size = store.shape[1]
    store[slots // size, slots % size] = rows.to(store.dtype)


def _read_rows(store: torch.Tensor, blocks: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` rows of these blocks, in order: [count, width], or [n, count, width] for n tables [n, nb]."""
    rows = store.index_select(0, blocks.flatten()).unflatten(0, blocks.shape).flatten(-3, -2)
    return rows[..., :count, :]


def _slots(blocks: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots (block × block_size + offset) of a sequence's rows, given its block table."""
    return blocks[rows // block_size] * block_size + rows % block_size


def _gather_rows(store: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows [n, k] (indices into the sequence's rows) of one block table [nb] or of one table per query
    [n, nb]: [n, k, width]."""
    size = store.shape[1]
    ids = blocks[rows // size] if blocks.dim() == 1 else blocks.gather(1, rows // size)
    return store[ids, rows % size]
