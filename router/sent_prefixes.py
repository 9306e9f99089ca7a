"""Prefixes this router has just sent to each worker, before the worker's prefix cache reports them.

The prefix directory learns a prompt's blocks only once its worker has computed them and heartbeated:
under load that takes seconds, and every request with the same prefix arriving meanwhile would see no
cache anywhere and be placed by load alone, so the fleet would compute one hot prefix on every worker. The
router therefore counts what it sent a worker as cached there for a while (SGLang's router goes further and
trusts only its own record; the directory stays the truth once it has heard)."""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict

# Long enough to cover a queue wait and a prefill, short enough that a wrong guess (the worker evicted the
# blocks at once) stops misleading the router soon.
EXPECT_S = 15.0
MAX_BLOCKS_PER_WORKER = 1 << 16


class SentPrefixes:
    def __init__(self, expect_s: float = EXPECT_S, max_blocks: int = MAX_BLOCKS_PER_WORKER):
        self.expect_s, self.max_blocks = expect_s, max_blocks
        self._sent: dict[str, OrderedDict[int, float]] = defaultdict(OrderedDict)  # worker -> hash -> until

    def record(self, worker_id: str, block_hashes: list[int]) -> None:
        sent, until = self._sent[worker_id], time.monotonic() + self.expect_s
        for block_hash in block_hashes:
            sent[block_hash] = until
            sent.move_to_end(block_hash)
        while len(sent) > self.max_blocks:
            sent.popitem(last=False)

    def keep_only(self, worker_ids: list[str]) -> None:
        """Forgets workers no longer live (their ids do not come back: a restart gets a new pid)."""
        for gone in self._sent.keys() - set(worker_ids):
            del self._sent[gone]

    def leading_blocks(self, worker_id: str, block_hashes: list[int]) -> int:
        sent, now, count = self._sent.get(worker_id), time.monotonic(), 0
        if not sent:
            return 0
        for block_hash in block_hashes:
            if sent.get(block_hash, 0.0) < now:
                break
            count += 1
        return count
