"""Maps sequences to KV blocks: allocation on demand as they grow, sharing for n > 1 and for cached
prefixes, release on finish."""

from __future__ import annotations

from .block_hash import BlockKey, extend_keys
from .block_pool import BlockPool
from .sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self._keys: dict[int, list[BlockKey]] = {}  # per sequence: keys of its full blocks, in order
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of which found

    def _extend_keys(self, seq: Sequence, num_blocks: int) -> list[BlockKey]:
        return extend_keys(self._keys.setdefault(seq.seq_id, []), seq.token_ids, self.block_size, num_blocks,
                           seq.cache_salt)

    def reuse_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence about to start: take the cached blocks of its longest cached prefix; returns the
        tokens they hold. At least one token is left to compute, so the sequence samples from its own logits."""
        if not self.enable_prefix_caching or self.block_tables.get(seq.seq_id):
            return 0
        if seq.params.prompt_logprobs is not None:  # it needs the logits of every prompt position
            return 0
        keys = self._extend_keys(seq, (seq.num_tokens - 1) // self.block_size)
        hits = []
        for key in keys:
            if (block := self.pool.lookup(key)) is None:
                break
            hits.append(block)
        self.pool.share(hits)
        self.block_tables[seq.seq_id] = hits
        return len(hits) * self.block_size

    def count_prefix_query(self, seq: Sequence, hit_tokens: int) -> None:
        """Once per admission: a sequence that did not fit and is looked up again next step counts once."""
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks `seq` has filled completely, so later sequences with this prefix reuse them."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(seq.seq_id, [])
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        for block, key in zip(table[:full], self._extend_keys(seq, full)[:full], strict=True):
            self.pool.cache(block, key)

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
        self._keys.pop(seq.seq_id, None)

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
