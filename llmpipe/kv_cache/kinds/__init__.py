"""KV-cache kinds: one spec class (and, where it differs, one group manager) per kind of attention."""

from llmpipe.kv_cache.kinds.base import BlockTable, ChunkRows, GroupBatch, GroupManager, KVCacheSpec
from llmpipe.kv_cache.kinds.compressed import CompressedMetadata, CompressedSpec
from llmpipe.kv_cache.kinds.full_attention import FullAttentionSpec
from llmpipe.kv_cache.kinds.recurrent import RecurrentMetadata, RecurrentState, RecurrentStateSpec, StateChunk, StateTable
from llmpipe.kv_cache.kinds.sliding_window import SlidingWindowSpec


def attention_spec(window: int | None) -> KVCacheSpec:
    """The spec of a layer that caches K/V per token and reads the last `window` tokens (None: all of them)."""
    return FullAttentionSpec() if window is None else SlidingWindowSpec(window)

__all__ = ["BlockTable", "ChunkRows", "CompressedMetadata", "CompressedSpec", "FullAttentionSpec", "GroupBatch",
           "GroupManager", "KVCacheSpec", "RecurrentMetadata", "RecurrentState", "RecurrentStateSpec", "SlidingWindowSpec",
           "StateChunk", "StateTable", "attention_spec"]
