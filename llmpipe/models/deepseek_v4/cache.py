"""DeepSeek V4's paged cache: the window, the compressors' pending tokens, the compressed entries and
the indexer keys, all in one pool of blocks (attention.py reads and writes them).

Every layer has a window store, one row per token: its K=V vector and, on CSA / HCA layers, the
compressor's (and indexer's) projections of that token. It is a sliding-window group that keeps
max(window, the tokens of the widest open compression span) rows, so the pending tokens of the
next entries are always still there (and come back with a prefix-cache hit). CSA / HCA layers also
have an entry store, one row per `ratio` tokens: the entry (and, for CSA, the indexer key); it is a
group of ratio r (kv_cache/kinds/compressed.py), whose block spans block_size × r tokens and is
never freed while the sequence runs.

Stores of the same shape form groups as for other models (kv_cache/layout.py), and groups
share one pool of equal-sized pages (vLLM v1's hybrid allocator): a group of narrow rows packs more
layers into a page than one of wide rows, and where its layers are too few to fill the page side by
side, an entry group takes block_rows × block_size rows per layer instead (its block then spans
block_size × block_rows × ratio tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from llmpipe.config import EngineConfig, ModelConfig
from llmpipe.kv_cache.kinds import CompressedSpec, GroupBatch, SlidingWindowSpec
from llmpipe.kv_cache.layout import KVCacheGroup, KVCacheLayout
from llmpipe.layers.attention import AttentionMetadata
from llmpipe.models.deepseek_v4.config import CSA, WINDOW


@dataclass(frozen=True)
class CompressedKVLayout(KVCacheLayout):
    layer_caches: tuple[tuple[int, int | None], ...] = ()  # per model layer: (window store, entry store)
    row_elements: int = 0  # elements of one row of a page (a block holds block_size such rows)

    def layer_metadata(self, group_metas: list) -> list:
        meta = lambda cache: None if cache is None else group_metas[self.layer_groups[cache]]  # noqa: E731
        return [(meta(window), meta(entry)) for window, entry in self.layer_caches]

    def growth_bytes_per_token(self, bytes_per_token: int) -> int:
        return bytes_per_token  # CompressedKVCache counts the growth itself


@dataclass
class WindowStoreMetadata(AttentionMetadata):
    """A window store's metadata, plus the positions the layer's compressor needs (Python side, no sync)."""

    decode_positions: list[int] = field(default_factory=list)  # each decode row's position
    decode_lens: list[int] = field(default_factory=list)  # and its decode_context_lens
    chunk_starts: list[int] = field(default_factory=list)  # each prefill chunk's first position


@dataclass(frozen=True)
class WindowStore(SlidingWindowSpec):
    """One row per token (K=V, and on CSA / HCA layers the compressor's projections), `width` elements."""

    width: int = 0
    block_rows = 1  # rows per block_size tokens, as an entry store's

    def metadata(self, batch: GroupBatch, block_size: int, device: torch.device) -> WindowStoreMetadata:
        meta, size = super().metadata(batch, block_size, device), block_size
        return WindowStoreMetadata(
            **vars(meta), decode_positions=[n - 1 for n in batch.lens],
            decode_lens=[n - self.first_needed_block(n - 1, size) * size for n in batch.lens],
            chunk_starts=[start for _, start, _, _ in batch.chunks],
        )


@dataclass(frozen=True)
class EntryStore(CompressedSpec):
    """One row per `ratio` tokens: the pooled entry (and, for CSA, its indexer key), `width` elements."""

    width: int = 0


def store_specs(cfg: ModelConfig, layer: int) -> tuple[WindowStore, EntryStore | None]:
    """The window store's and the entry store's spec of one layer."""
    v4, head_dim = cfg.extra, cfg.head_dim
    kind = v4.layer_types[layer]
    if kind == WINDOW:
        return WindowStore(cfg.sliding_window, width=head_dim), None
    ratio, csa = v4.compress_rates[kind], kind == CSA
    # Pending rows: HCA pools the current window; CSA also the previous window's Ca half (2 × ratio tokens).
    keep = max(cfg.sliding_window, 2 * ratio if csa else ratio)
    projections = 2 * 2 * head_dim + 2 * 2 * v4.index_head_dim if csa else 2 * head_dim  # value and gate
    entry_width = head_dim + (v4.index_head_dim if csa else 0)
    return WindowStore(keep, width=head_dim + projections), EntryStore(ratio, width=entry_width)


def compressed_kv_layout(layer_stores: Sequence[tuple[WindowStore, EntryStore | None]]) -> CompressedKVLayout:
    """Each layer's stores (as its attention reports them) grouped by spec into pages of one width: of the
    widths that fit the widest row and pack some entry store exactly, the one whose entry pages grow least
    per token (they are what grows)."""
    caches: list[WindowStore | EntryStore] = []
    layer_caches = []
    for window, entry in layer_stores:
        caches.append(window)
        layer_caches.append((len(caches) - 1, None if entry is None else len(caches)))
        if entry is not None:
            caches.append(entry)
    widest = max(spec.width for spec in caches)
    rows = {widest} | {-(-widest // s.width) * s.width for s in caches if isinstance(s, EntryStore)}
    row, groups = min(((r, _groups(caches, r)) for r in rows), key=lambda rg: (_growth(*rg), rg[0]))
    slots, owners = [0] * len(caches), [0] * len(caches)
    for index, group in enumerate(groups):
        for slot, cache in enumerate(group.layers):
            slots[cache], owners[cache] = slot, index
    return CompressedKVLayout(tuple(groups), max(len(g.layers) for g in groups), tuple(slots), tuple(owners),
                              tuple(layer_caches), row)


def _groups(caches: list[WindowStore | EntryStore], row: int) -> list[KVCacheGroup]:
    """Stores of one spec side by side, as many as fit a page row; entry stores too few to fill it take
    more rows each."""
    by_spec: dict[WindowStore | EntryStore, list[int]] = {}
    for cache, spec in enumerate(caches):
        by_spec.setdefault(spec, []).append(cache)
    largest_ratio = math.lcm(*(spec.ratio for spec in caches if isinstance(spec, EntryStore)))
    groups = []
    for spec, members in by_spec.items():
        size = min(len(members), row // spec.width)
        for i in range(0, len(members), size):
            layers = tuple(members[i : i + size])
            if isinstance(spec, EntryStore):
                fit = row // (len(layers) * spec.width)
                spec = replace(spec, block_rows=_block_rows(fit, spec.ratio, largest_ratio))
            groups.append(KVCacheGroup(spec, layers))
    return groups


def _growth(row: int, groups: list[KVCacheGroup]) -> float:
    """Page elements per token of the entry groups."""
    return sum(row / g.spec.span for g in groups if g.spec.grows)


def _block_rows(fit: int, ratio: int, largest_ratio: int) -> int:
    """The most rows (≤ fit) whose block still spans a divisor of the largest ratio's block (where prefix hits
    must cover whole blocks, without partial-block copies, a longer span would coarsen every hit)."""
    return max(m for m in range(1, fit + 1) if largest_ratio % (ratio * m) == 0)


class CompressedKVCache:
    """One tensor [blocks, block_size × row_elements]; each store is a strided view of its slot."""

    def __init__(self, layout: CompressedKVLayout, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        self.pool = torch.zeros(num_blocks, block_size * layout.row_elements, dtype=dtype, device=device)
        self.tensors = (self.pool,)
        stores = []
        for cache, slot in enumerate(layout.layer_slots):
            group = layout.groups[layout.layer_groups[cache]]
            rows, width = block_size * group.spec.block_rows, group.spec.width
            page = self.pool[:, : len(group.layers) * rows * width]
            stores.append(page.view(num_blocks, len(group.layers), rows, width)[:, slot])
        self.layers = [(stores[w], None if e is None else stores[e]) for w, e in layout.layer_caches]
        # What each further token adds: the pages of the entry stores (window stores stop growing).
        page_bytes = self.pool[0].nbytes
        self.bytes_per_token = round(sum(
            page_bytes / g.spec.tokens_per_block(block_size) for g in layout.groups if g.spec.grows
        ))

    @classmethod
    def layout(cls, specs: Sequence[tuple[WindowStore, EntryStore | None]]) -> CompressedKVLayout:
        return compressed_kv_layout(specs)

    @classmethod
    def block_bytes(cls, layout: CompressedKVLayout, cfg: ModelConfig, config: EngineConfig) -> int:
        return config.block_size * layout.row_elements * config.torch_dtype.itemsize

    @classmethod
    def build(cls, cfg: ModelConfig, layout: CompressedKVLayout, num_blocks: int, config: EngineConfig,
              device: torch.device) -> "CompressedKVCache":
        return cls(layout, num_blocks, config.block_size, config.torch_dtype, device)

    def copy_block(self, src: int, dst: int) -> None:
        self.pool[dst] = self.pool[src]

