"""What each attention layer keeps in the KV cache, and how layers share the block pool (vLLM v1's
KV cache groups).

Each layer reports its cache spec as plain data (its attention's `kv_cache_spec()`, gathered by
`kv_cache_specs(model)`): which past tokens its queries can still read, every one (full
attention) or the last W (sliding window). Layers with the same spec are cut into groups of equal size S, so
that one block of the pool — [S layers, K and V, block_size tokens] — fits any group: a block
belongs to one group at a time, and each sequence has one block table per group. A window group
frees the blocks its queries can no longer reach while the sequence goes on; a full group keeps
everything. Llama-style models are one full group (S = all layers); Mistral with a window one
sliding group; Gemma 3 (5 local layers per global one) several groups of each kind. Layers that keep a fixed
state per sequence instead (a recurrent spec's `per_sequence`: Qwen3.5's linear attention) form one group of
their own, whose states come from a pool of their own (kv_cache/kinds/recurrent.py). A model family may lay out
its cache its own way (its `kv_cache_class`), with kinds of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Sequence

from torch import nn

from llmpipe.kv_cache.kinds import KVCacheSpec


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

    @property
    def token_layers(self) -> int:
        """Layers whose cache lives in token blocks (the others keep a state per sequence)."""
        return sum(len(g.layers) for g in self.groups if not g.spec.per_sequence)

    @property
    def state_group(self) -> KVCacheGroup | None:
        """The group of the layers that keep a state per sequence, if the model has any."""
        return next((g for g in self.groups if g.spec.per_sequence), None)

    def state_bytes(self) -> int:
        """Bytes of one sequence's states, over every layer that keeps one."""
        group = self.state_group
        return 0 if group is None else len(group.layers) * group.spec.layer_bytes

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks one sequence of num_tokens tokens holds, over all groups."""
        return sum(group.spec.blocks_held(num_tokens, block_size) for group in self.groups)

    def layer_metadata(self, group_metas: list) -> list:
        """What each layer's attention receives: its group's metadata."""
        return [group_metas[g] for g in self.layer_groups]

    def growth_bytes_per_token(self, bytes_per_token: int) -> int:
        """Bytes each further token adds to a sequence (full-attention layers; windows stop growing)."""
        full_layers = sum(len(g.layers) for g in self.groups if g.spec.grows)
        return bytes_per_token * full_layers // self.token_layers

    def block_bytes(self, bytes_per_token: int, block_size: int) -> int:
        """Bytes of one block, from the bytes a token takes in all layers."""
        return bytes_per_token * self.slots_per_block // self.token_layers * block_size

    def max_tokens(self, num_blocks: int, block_size: int, chunk: int, limit: int) -> int:
        """The longest sequence (up to `limit`) the pool holds alone, prefilled in chunks of at most `chunk` tokens."""
        def peak(tokens: int) -> int:
            return sum(g.spec.peak_blocks(tokens, block_size, chunk) for g in self.groups)
        low, high = 0, limit  # peak(low) fits; the answer is at most `high`
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if peak(mid) <= num_blocks else (low, mid - 1)
        return low


def kv_cache_specs(model: nn.Module) -> list:
    """What each layer of `model` keeps in the KV cache, in layer order: the `kv_cache_spec()` of every
    module that reports one (its attention), plain data the pool and its group managers are built from."""
    return [module.kv_cache_spec() for module in model.modules() if hasattr(module, "kv_cache_spec")]


def kv_cache_layout(specs: Sequence[KVCacheSpec]) -> KVCacheLayout:
    """Group the layers (specs[i]: what layer i keeps, as the model reports it) by spec into groups of S
    layers, S the smallest spec's layer count (a larger spec whose count S does not divide leaves slots
    of its last group unused). Layers keeping a state per sequence form one group (slot = their rank in it)."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer)
    states = [spec for spec in by_spec if spec.per_sequence]
    if len(states) > 1:
        raise ValueError(f"layers keep states of {len(states)} different shapes; one state pool holds one shape")
    size = min((len(layers) for spec, layers in by_spec.items() if not spec.per_sequence), default=1)
    groups = tuple(
        KVCacheGroup(spec, tuple(layers[i : i + step]))
        for spec, layers in by_spec.items()
        for step in [len(layers) if spec.per_sequence else size]
        for i in range(0, len(layers), step)
    )
    slots, owners = [0] * len(specs), [0] * len(specs)
    for index, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            slots[layer], owners[layer] = slot, index
    return KVCacheLayout(groups, size, tuple(slots), tuple(owners))
