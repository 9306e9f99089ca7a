"""Fixed pool of KV-cache block ids with reference counts (integers only, no tensors)."""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._refcount[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refcount[block] += 1

    def release(self, blocks: list[int]) -> None:
        # Reversed so that a sequence's tail blocks are reused last: they are the least likely to be shared.
        for block in reversed(blocks):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                self._free.append(block)
            elif self._refcount[block] < 0:
                raise RuntimeError(f"KV block {block} released more often than allocated")
