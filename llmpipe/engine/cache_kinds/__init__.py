"""KV-cache kinds: one spec class (and, where it differs, one group manager) per kind of attention."""

from llmpipe.engine.cache_kinds.base import BlockTable, ChunkRows, GroupBatch, GroupManager, KVCacheSpec
from llmpipe.engine.cache_kinds.compressed import CompressedMetadata, CompressedSpec
from llmpipe.engine.cache_kinds.full_attention import FullAttentionSpec
from llmpipe.engine.cache_kinds.sliding_window import SlidingWindowSpec

__all__ = ["BlockTable", "ChunkRows", "CompressedMetadata", "CompressedSpec", "FullAttentionSpec", "GroupBatch",
           "GroupManager", "KVCacheSpec", "SlidingWindowSpec"]
