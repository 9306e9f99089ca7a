"""Maps sequences to KV blocks: allocation on demand as they grow, sharing for n > 1 and for cached
prefixes, release on finish.

A sequence has a block table per KV-cache group (`kv_cache_groups.py`: one for most models, one per group of
layers alike for hybrid ones), all of one length, allocating from one pool. In a group whose layers slide (`window`:
each token sees itself and the window - 1 tokens before it), a block whose tokens every later query of its
sequence is past goes back to the pool as the sequence grows: the group holds O(window) blocks, not O(length).
Its entry in the table becomes FREED (-1), which no kernel reads: attention starts at the window's first block.
A released block keeps its prefix-cache key, as any freed block does, so a later request with the same prefix
finds it while it is not reused.

A prefix hit of n blocks needs, in each group, the blocks its next query reads: all n in a full-attention group,
in a sliding one those the window before token n * block_size spans (the earlier ones are FREED in the new
table). The hit is the longest prefix for which every group holds them (vLLM's rule for hybrid models)."""

from __future__ import annotations

from collections.abc import Iterable

from services.text.block_hash import BlockKey, extend_keys

from .block_pool import BlockPool
from .sequence import Sequence

FREED = -1  # a block-table entry whose block went back to the pool, out of its group's window


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Iterable[int | None] = (None,)):
        """`windows`: each KV-cache group's sliding window, None where its layers attend to the whole context."""
        self.block_size = block_size
        self.windows = list(windows)
        self.pool = BlockPool(num_blocks)
        self.tables: dict[int, list[list[int]]] = {}  # per sequence: its block table in each group
        self._num_freed: dict[int, list[int]] = {}  # per sequence and group: the leading entries that are FREED
        self.enable_prefix_caching = enable_prefix_caching
        self._keys: dict[int, list[BlockKey]] = {}  # per sequence: keys of its full blocks, in order
        self._num_registered: dict[int, int] = {}  # per sequence: its leading full blocks registered in the cache
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of which found

    def _extend_keys(self, seq: Sequence, num_blocks: int) -> list[BlockKey]:
        return extend_keys(self._keys.setdefault(seq.seq_id, []), seq.token_ids, self.block_size, num_blocks,
                           seq.cache_salt)

    def _first_needed(self, window: int | None, num_tokens: int) -> int:
        """The first block a query at position `num_tokens` reads in a group with `window`."""
        return 0 if window is None else max(0, num_tokens - window + 1) // self.block_size

    def reuse_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence about to start: take the cached blocks of its longest cached prefix; returns the
        tokens they hold. At least one token is left to compute, so the sequence samples from its own logits."""
        if not self.enable_prefix_caching or any(self.tables.get(seq.seq_id, ())):
            return 0
        if seq.params.prompt_logprobs is not None:  # it needs the logits of every prompt position
            return 0
        keys = self._extend_keys(seq, (seq.num_tokens - 1) // self.block_size)
        found = [[self.pool.lookup(g, key) for key in keys] for g in range(len(self.windows))]
        hit = len(keys)
        for blocks, window in zip(found, self.windows, strict=True):
            if window is None and None in blocks[:hit]:
                hit = blocks.index(None)
        while hit > 0:  # shortened until every sliding group holds its window's blocks
            missing = [j for blocks, window in zip(found, self.windows, strict=True) if window is not None
                       for j in range(self._first_needed(window, hit * self.block_size), hit) if blocks[j] is None]
            if not missing:
                break
            hit = max(missing)
        tables, freed = [], []
        for blocks, window in zip(found, self.windows, strict=True):
            first = self._first_needed(window, hit * self.block_size)
            self.pool.share(blocks[first:hit])
            tables.append([FREED] * first + blocks[first:hit])
            freed.append(first)
        self.tables[seq.seq_id], self._num_freed[seq.seq_id] = tables, freed
        return hit * self.block_size

    def count_prefix_query(self, seq: Sequence, hit_tokens: int) -> None:
        """Once per admission: a sequence that did not fit and is looked up again next step counts once."""
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks `seq` has filled completely, so later sequences with this prefix reuse them."""
        tables = self.tables.get(seq.seq_id)
        if not self.enable_prefix_caching or not tables:
            return
        done = self._num_registered.get(seq.seq_id, 0)
        full = min(seq.num_computed_tokens // self.block_size, len(tables[0]))
        if full <= done:
            return
        keys = self._extend_keys(seq, full)
        for g, table in enumerate(tables):
            for block, key in zip(table[done:full], keys[done:full], strict=True):
                if block != FREED:
                    self.pool.cache(g, block, key)
        self._num_registered[seq.seq_id] = full

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow `seq`'s block tables to hold its computed tokens plus `num_new_tokens`; False if no room. In a
        sliding group, the blocks the new tokens' queries are all past go back to the pool first."""
        tables = self.tables.get(seq.seq_id)
        if tables:
            for g, window in enumerate(self.windows):
                if window is not None:
                    self._release_out_of_window(seq, g, window)
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - (len(tables[0]) if tables else 0)
        if needed * len(self.windows) > self.pool.num_free:
            return False
        if needed > 0:
            if not tables:
                tables = self.tables[seq.seq_id] = [[] for _ in self.windows]
                self._num_freed[seq.seq_id] = [0] * len(self.windows)
            for table in tables:
                table.extend(self.pool.allocate(needed))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Share the parent's full prompt blocks with `child`; returns how many tokens the child skips.

        At least one prompt token is left for the child to compute, so that it samples its own first token
        from its own logits, and the shared blocks are full, so nobody writes into them again. The child's first
        query needs its window before it in every sliding group: all there, or nothing is shared.
        """
        num_shared = (parent.num_prompt_tokens - 1) // self.block_size
        shared = [table[:num_shared] for table in self.tables[parent.seq_id]]
        if any(FREED in table[self._first_needed(window, num_shared * self.block_size):]
               for table, window in zip(shared, self.windows, strict=True)):
            num_shared, shared = 0, [[] for _ in self.windows]
        for table in shared:
            self.pool.share([b for b in table if b != FREED])
        self.tables[child.seq_id] = shared
        self._num_freed[child.seq_id] = [table.count(FREED) for table in shared]
        return num_shared * self.block_size

    def free(self, seq: Sequence) -> None:
        # Position by position across the groups: the pool evicts the sequence's tail first in every group alike.
        self.pool.release([b for blocks in zip(*self.tables.pop(seq.seq_id, ()), strict=True) for b in blocks
                           if b != FREED])
        self._keys.pop(seq.seq_id, None)
        self._num_freed.pop(seq.seq_id, None)
        self._num_registered.pop(seq.seq_id, None)

    def _release_out_of_window(self, seq: Sequence, group: int, window: int) -> None:
        """The next query (at num_computed_tokens) sees from window - 1 tokens before it; so does every later one."""
        table = self.tables[seq.seq_id][group]
        past = min(self._first_needed(window, seq.num_computed_tokens), len(table))
        freed = self._num_freed[seq.seq_id]
        if past > freed[group]:
            self.pool.release([b for b in table[freed[group]:past] if b != FREED])
            table[freed[group]:past] = [FREED] * (past - freed[group])
            freed[group] = past

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s block table in each group (live: they grow as the sequence does)."""
        return self.tables[seq.seq_id]

    def num_held_blocks(self, seq: Sequence) -> int:
        """The blocks `seq` holds now, in every group (its tables less their FREED entries)."""
        return sum(len(t) for t in self.tables.get(seq.seq_id, ())) - sum(self._num_freed.get(seq.seq_id, ()))

    @property
    def usage(self) -> float:
        return self.pool.usage

    def partial_block_waste(self, seqs: list[Sequence]) -> int:
        """Slots allocated in a table but not holding computed KV, summed over `seqs` (bounded by one block each;
        every group's tables have the same length)."""
        return sum(len(self.tables[s.seq_id][0]) * self.block_size - s.num_computed_tokens
                   for s in seqs if s.seq_id in self.tables)
