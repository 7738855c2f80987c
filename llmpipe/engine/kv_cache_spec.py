"""What each attention layer keeps in the KV cache, and how layers share the block pool (vLLM v1's
KV cache groups).

A layer's cache spec says which past tokens its queries can still read: every one (full attention)
or the last W (sliding window). Layers with the same spec are cut into groups of equal size S, so
that one block of the pool — [S layers, K and V, block_size tokens] — fits any group: a block
belongs to one group at a time, and each sequence has one block table per group. A window group
frees the blocks its queries can no longer reach while the sequence goes on; a full group keeps
everything. Llama-style models are one full group (S = all layers); Mistral with a window one
sliding group; Gemma 3 (5 local layers per global one) several groups of each kind. DeepSeek V4's
compressed groups keep one row per `ratio` tokens, so their blocks span block_size × ratio tokens
(engine/compressed_kv_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmpipe.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    window: int | None  # None: full attention
    # Tokens per cache row: 1 for K/V, r for compressed entries (a block then spans block_size × r tokens).
    ratio: int = 1
    width: int = 0  # elements of one layer's row where rows are not K and V of the model's heads (DeepSeek V4)
    block_rows: int = 1  # a block holds block_size × block_rows rows per layer (narrow rows fill a wide page)

    @property
    def name(self) -> str:
        kind = "full" if self.window is None else f"sliding_window({self.window})"
        return kind if self.ratio == 1 else f"compressed({self.ratio})"

    @property
    def span(self) -> int:
        """Token blocks (of block_size tokens) one block of this spec covers."""
        return self.ratio * self.block_rows

    def tokens_per_block(self, block_size: int) -> int:
        return block_size * self.span

    def first_needed_block(self, position: int, block_size: int) -> int:
        """Lowest block a query at `position`, or at any later position, still reads."""
        return 0 if self.window is None else max(0, position - self.window + 1) // block_size

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of num_tokens computed tokens holds between steps (the next query is at num_tokens)."""
        return -(-num_tokens // self.tokens_per_block(block_size)) - self.first_needed_block(num_tokens, block_size)


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layers: tuple[int, ...]  # at most `slots_per_block` layers; layer layers[j] uses slot j of a block


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    slots_per_block: int  # S: layers one block holds
    layer_slots: tuple[int, ...]  # layer → its slot in a block
    layer_groups: tuple[int, ...]  # layer → its group

    @property
    def num_layers(self) -> int:
        return len(self.layer_slots)

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks one sequence of num_tokens tokens holds, over all groups."""
        return sum(group.spec.blocks_held(num_tokens, block_size) for group in self.groups)

    def layer_metadata(self, group_metas: list) -> list:
        """What each layer's attention receives: its group's metadata."""
        return [group_metas[g] for g in self.layer_groups]

    def growth_bytes_per_token(self, bytes_per_token: int) -> int:
        """Bytes each further token adds to a sequence (full-attention layers; windows stop growing)."""
        full_layers = sum(len(g.layers) for g in self.groups if g.spec.window is None)
        return bytes_per_token * full_layers // self.num_layers

    def block_bytes(self, bytes_per_token: int, block_size: int) -> int:
        """Bytes of one block, from the bytes a token takes in all layers."""
        return bytes_per_token * self.slots_per_block // self.num_layers * block_size

    def max_tokens(self, num_blocks: int, block_size: int, chunk: int, limit: int) -> int:
        """The longest sequence (up to `limit`) the pool holds alone, prefilled in chunks of at most `chunk` tokens."""
        def peak(tokens: int) -> int:
            return sum(
                -(-tokens // g.spec.tokens_per_block(block_size)) if g.spec.window is None
                else min(-(-tokens // block_size), -(-(g.spec.window + chunk) // block_size) + 1)
                for g in self.groups
            )
        low, high = 0, limit  # peak(low) fits; the answer is at most `high`
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if peak(mid) <= num_blocks else (low, mid - 1)
        return low


def kv_cache_layout(cfg: ModelConfig) -> KVCacheLayout:
    """Group the layers by spec into groups of S layers, S the smallest spec's layer count (a larger
    spec whose count S does not divide leaves slots of its last group unused)."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer in range(cfg.num_hidden_layers):
        by_spec.setdefault(KVCacheSpec(cfg.layer_window(layer)), []).append(layer)
    size = min(len(layers) for layers in by_spec.values())
    groups = tuple(
        KVCacheGroup(spec, tuple(layers[i : i + size])) for spec, layers in by_spec.items() for i in range(0, len(layers), size)
    )
    slots, owners = [0] * cfg.num_hidden_layers, [0] * cfg.num_hidden_layers
    for index, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            slots[layer], owners[layer] = slot, index
    return KVCacheLayout(groups, size, tuple(slots), tuple(owners))
