"""Fixed pool of KV-cache block ids with reference counts and a prefix cache (integers only, no tensors).

A full block can be registered under its `BlockKey` (block_hash.py: a SHA-256 chain over every token up to
it) and its KV-cache group (`kv_cache_groups.py`: the same tokens' block differs from group to group). A freed
block keeps its key and waits in the free list, oldest first, until a later request with the same prefix takes it
back (`share`) or the pool needs room (`allocate` evicts it). The event log and `cached_hashes` speak of group 0's
blocks alone: the fleet's prefix directory asks which worker holds a prefix, not in which groups.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from services.text.block_hash import BlockKey, block_id


class KVEventLog:
    """Hashes of blocks that entered or left the prefix cache since the last `drain`, for the fleet's prefix
    directory. Bounded: an engine nobody drains (a benchmark, `LLM`) keeps only the latest events and says
    it overflowed, so a drainer that fell behind resends its whole set instead of a gap. Locked: the async
    engine steps in a thread while the worker drains on its event loop."""

    def __init__(self, max_events: int = 1 << 16):
        self.max_events = max_events
        self._events: list[tuple[bool, int]] = []  # (added, block hash)
        self._overflowed = False
        self._lock = threading.Lock()

    def record(self, added: bool, key: BlockKey) -> None:
        with self._lock:
            if len(self._events) >= self.max_events:
                self._events.clear()
                self._overflowed = True
            self._events.append((added, block_id(key)))

    def drain(self) -> tuple[list[tuple[bool, int]], bool]:
        """(events in order, whether some were lost since the last drain)."""
        with self._lock:
            events, overflowed = self._events, self._overflowed
            self._events, self._overflowed = [], False
        return events, overflowed


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # evicted front first
        self._refcount = [0] * num_blocks
        self._key_of: list[tuple[int, BlockKey] | None] = [None] * num_blocks  # (group, key)
        self._cached: dict[tuple[int, BlockKey], int] = {}
        self.num_evicted = 0
        self.events = KVEventLog()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for block in blocks:
            self._refcount[block] = 1
            if (cached := self._key_of[block]) is not None:  # evict its cached prefix
                del self._cached[cached]
                self._key_of[block] = None
                self.num_evicted += 1
                if cached[0] == 0:
                    self.events.record(False, cached[1])
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder for each block; a free (cached) block is taken back out of the free list."""
        for block in blocks:
            if self._refcount[block] == 0:
                del self._free[block]
            self._refcount[block] += 1

    def release(self, blocks: list[int]) -> None:
        # Reversed, so a sequence's tail blocks are evicted first: its head is the likeliest to be shared.
        for block in reversed(blocks):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                self._free[block] = None
            elif self._refcount[block] < 0:
                raise RuntimeError(f"KV block {block} released more often than allocated")

    def cache(self, group: int, block: int, key: BlockKey) -> None:
        """Register a full block of `group` under its prefix key (a block with the same key already cached wins)."""
        if self._key_of[block] is None and (group, key) not in self._cached:
            self._cached[group, key] = block
            self._key_of[block] = (group, key)
            if group == 0:
                self.events.record(True, key)

    def lookup(self, group: int, key: BlockKey) -> int | None:
        return self._cached.get((group, key))

    def cached_hashes(self) -> list[int]:
        """Every block hash group 0 holds now: a full resend after `events` overflowed."""
        # list(): one step under the GIL, safe beside a step
        return [block_id(key) for group, key in list(self._cached) if group == 0]
