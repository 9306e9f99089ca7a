"""Maps sequences to KV blocks: allocation on demand as they grow, sharing for n > 1, release on finish."""

from __future__ import annotations

from .block_pool import BlockPool
from .sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[int]] = {}

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow `seq`'s block table to hold its computed tokens plus `num_new_tokens`; False if no room."""
        held = len(self.block_tables.get(seq.seq_id, ()))
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - held
        if needed > self.pool.num_free:
            return False
        if needed > 0:
            self.block_tables.setdefault(seq.seq_id, []).extend(self.pool.allocate(needed))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Share the parent's full prompt blocks with `child`; returns how many tokens the child skips.

        At least one prompt token is left for the child to compute, so that it samples its own first token
        from its own logits, and the shared blocks are full, so nobody writes into them again.
        """
        num_shared_blocks = (parent.num_prompt_tokens - 1) // self.block_size
        shared = self.block_tables[parent.seq_id][:num_shared_blocks]
        self.pool.share(shared)
        self.block_tables[child.seq_id] = list(shared)
        return num_shared_blocks * self.block_size

    def free(self, seq: Sequence) -> None:
        self.pool.release(self.block_tables.pop(seq.seq_id, []))

    def block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables[seq.seq_id]

    @property
    def usage(self) -> float:
        return self.pool.usage

    def partial_block_waste(self, seqs: list[Sequence]) -> int:
        """Slots allocated but not holding computed KV, summed over `seqs` (bounded by one block each)."""
        return sum(
            len(self.block_tables.get(s.seq_id, [])) * self.block_size - s.num_computed_tokens for s in seqs
        )
