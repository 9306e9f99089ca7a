"""Maps sequences to KV blocks: allocation on demand as they grow, sharing for n > 1 and for cached
prefixes, release on finish.

With sliding-window attention in every layer (`window`: each token sees itself and the window - 1 tokens before it),
a block whose tokens every later query of its sequence is past goes back to the pool as the sequence grows: a
sequence holds O(window) blocks, not O(length). Its entry in the block table becomes FREED (-1), which no kernel
reads: attention starts at the window's first block. A released block keeps its prefix-cache key, as any freed
block does, so a later request with the same prefix still finds it while it is not reused: a prefix hit needs
every block of the prefix, as with full attention."""

from __future__ import annotations

from services.text.block_hash import BlockKey, extend_keys

from .block_pool import BlockPool
from .sequence import Sequence

FREED = -1  # a block-table entry whose block went back to the pool, out of every layer's window


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        """`window`: the sliding window of every layer, None where any layer attends to the whole context."""
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self._num_freed: dict[int, int] = {}  # per sequence: its leading table entries that are FREED
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
            if block != FREED:
                self.pool.cache(block, key)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow `seq`'s block table to hold its computed tokens plus `num_new_tokens`; False if no room. With a
        window, the blocks the new tokens' queries are all past go back to the pool first."""
        if self.window is not None:
            self._release_out_of_window(seq)
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
        if self.window is not None:  # the child's first query needs the window before it: all there, or none
            first_needed = max(0, num_shared_blocks * self.block_size - self.window + 1) // self.block_size
            if FREED in shared[first_needed:]:
                num_shared_blocks, shared = 0, []
        self.pool.share([b for b in shared if b != FREED])
        self.block_tables[child.seq_id] = list(shared)
        self._num_freed[child.seq_id] = shared.count(FREED)
        return num_shared_blocks * self.block_size

    def free(self, seq: Sequence) -> None:
        self.pool.release([b for b in self.block_tables.pop(seq.seq_id, []) if b != FREED])
        self._keys.pop(seq.seq_id, None)
        self._num_freed.pop(seq.seq_id, None)

    def _release_out_of_window(self, seq: Sequence) -> None:
        """The next query (at num_computed_tokens) sees from window - 1 tokens before it; so does every later one."""
        table = self.block_tables.get(seq.seq_id)
        if not table:
            return
        past = min(max(0, seq.num_computed_tokens - self.window + 1) // self.block_size, len(table))
        done = self._num_freed.get(seq.seq_id, 0)
        if past > done:
            self.pool.release([b for b in table[done:past] if b != FREED])
            table[done:past] = [FREED] * (past - done)
            self._num_freed[seq.seq_id] = past

    def block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables[seq.seq_id]

    def num_held_blocks(self, seq: Sequence) -> int:
        """The blocks `seq` holds now (its table less the FREED entries)."""
        return len(self.block_tables.get(seq.seq_id, ())) - self._num_freed.get(seq.seq_id, 0)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def partial_block_waste(self, seqs: list[Sequence]) -> int:
        """Slots allocated but not holding computed KV, summed over `seqs` (bounded by one block each)."""
        return sum(
            len(self.block_tables.get(s.seq_id, [])) * self.block_size - s.num_computed_tokens for s in seqs
        )
