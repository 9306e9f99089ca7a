"""Which layers share a block table: KV-cache groups, as vLLM's hybrid allocator forms them.

A model whose layers all attend alike (all to the whole context, or all through one sliding window) is one group:
a sequence has one block table, and a block id stands for that token range's keys and values in every layer. A
hybrid model (Gemma 2/3, gpt-oss: sliding and full layers) would waste memory so: its sliding layers need only the
window's blocks, its full layers every block. Its layers are grouped by window instead, each group with a block
table of its own per sequence, every group allocating from one pool of block ids.

The groups are of one size, `num_slots` layers: a block id then names one block in `num_slots` cache tensors, and
layer i's cache is the tensor of its slot (its place in its group), shared with the layers at the same place in the
other groups. A kind of layer (a window, or none) is split into groups of the smallest kind's size; its last group
may hold fewer layers, leaving slots of its blocks unused (vLLM pads the same way). Full-attention groups come
first: group 0 is the one the fleet's prefix directory hears about and a separate draft model's cache follows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # the model's layers whose caches this group's tables index, slot by slot
    window: int | None  # their sliding window; None: they attend to the whole context


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    num_layers: int

    @classmethod
    def of_windows(cls, windows: list[int | None]) -> KVCacheLayout:
        """The groups for layers with these windows (None: full attention), one window per layer."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in sorted(enumerate(windows), key=lambda lw: (lw[1] is not None, lw[1] or 0, lw[0])):
            kinds.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        return cls(tuple(KVCacheGroup(tuple(layers[i:i + size]), window)
                         for window, layers in kinds.items() for i in range(0, len(layers), size)), len(windows))

    @property
    def windows(self) -> list[int | None]:
        """Each group's window."""
        return [g.window for g in self.groups]

    @property
    def num_slots(self) -> int:
        """Cache tensors a block id spans: the layers of the largest group."""
        return max(len(g.layers) for g in self.groups)

    @property
    def group_of_layer(self) -> list[int]:
        groups = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                groups[layer] = g
        return groups

    def blocks_for(self, length: int, block_size: int, chunk: int) -> int:
        """The most blocks one sequence of `length` tokens holds at once, over every group: all of its blocks in a
        full group; in a sliding one those its window and a chunk of `chunk` new tokens span, unaligned."""
        full = -(-length // block_size)
        return sum(full if g.window is None else min(full, -(-(g.window - 1 + chunk) // block_size) + 2)
                   for g in self.groups)

    def caches_by_layer(self, slots: list) -> list:
        """Each layer's cache: the tensor of its slot among `slots` (`num_slots` of them)."""
        caches: list = [None] * self.num_layers
        for group in self.groups:
            for slot, layer in enumerate(group.layers):
                caches[layer] = slots[slot]
        return caches
