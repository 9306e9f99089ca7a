"""The prefix directory: which worker holds which KV prefix blocks, kept from the workers' add/evict events.

Workers write (`PrefixDirectory`): per worker a Redis set of the block hashes its prefix cache holds (see
`services/text/block_hash.py`), the state of record, and the same changes appended to the model's
prefix-events stream. Routers read (`PrefixIndex`): an in-memory copy, loaded from the sets and kept current
from the stream, so choosing a worker costs no Redis round trip (the decision sits on every request's path;
NVIDIA Dynamo's KV router and llm-d's indexer keep theirs in memory from worker events too).

A block hash stands for its whole prefix (the key chains through every parent), so a worker's cached
prefix of a prompt is its run of members from the prompt's first block on.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from services.base import protocol as p
from services.base.redis_client import BLOCK_MS

log = logging.getLogger(__name__)

# A worker that stops without cleaning up (killed) leaves its set; it expires unless refreshed.
SET_TTL_S = 60
EVENTS_MAXLEN = 10_000
# A router re-reads every set this often, whatever the stream said: a safety net for a gap in what it read.
RESYNC_S = 30.0


class PrefixDirectory:
    """The workers' side."""

    def __init__(self, redis: aioredis.Redis, model: str):
        self.redis, self.model = redis, model

    async def apply(self, worker_id: str, events: list[tuple[bool, int]], snapshot: list[int] | None) -> None:
        """A worker's events since its last call, in order; `snapshot` (all it holds) replaces the set."""
        if not events and snapshot is None:
            await self.redis.expire(p.prefix_blocks_key(self.model, worker_id), SET_TTL_S)
            return
        key = p.prefix_blocks_key(self.model, worker_id)
        runs = _runs([(True, h) for h in snapshot] if snapshot is not None else events)
        async with self.redis.pipeline(transaction=True) as pipe:
            if snapshot is not None:
                pipe.delete(key)
            for added, hashes in runs:
                (pipe.sadd if added else pipe.srem)(key, *hashes)
            pipe.expire(key, SET_TTL_S)
            change = p.PrefixChange(worker_id=worker_id, replace=snapshot is not None, runs=runs)
            pipe.xadd(p.prefix_events_stream(self.model), change.encode(), maxlen=EVENTS_MAXLEN, approximate=True)
            await pipe.execute()

    async def forget(self, worker_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(p.prefix_blocks_key(self.model, worker_id))
            pipe.xadd(p.prefix_events_stream(self.model), p.PrefixChange(worker_id=worker_id, replace=True).encode(),
                      maxlen=EVENTS_MAXLEN, approximate=True)
            await pipe.execute()


class PrefixIndex:
    """A router's in-memory copy of one model's directory. `follow()` keeps it current (run it as a task)."""

    def __init__(self, redis: aioredis.Redis, model: str):
        self.redis, self.model = redis, model
        self.held: dict[str, set[int]] = {}  # worker id -> block hashes
        self._cursor: str | None = None  # the last stream entry applied; None: not loaded

    def cached_blocks(self, block_hashes: list[int], workers: list[str]) -> dict[str, int]:
        """For each worker: how many of the prompt's leading blocks it holds."""
        counts = {}
        for worker in workers:
            held, count = self.held.get(worker, ()), 0
            for block_hash in block_hashes:
                if block_hash not in held:
                    break
                count += 1
            counts[worker] = count
        return counts

    async def load(self) -> None:
        """Every worker's set, as of a stream position from which `follow` goes on. Events between that
        position and the reads are applied again in order: harmless, they end in the same state."""
        last = await self.redis.xrevrange(p.prefix_events_stream(self.model), count=1)
        cursor = last[0][0] if last else "0-0"
        pattern = p.prefix_blocks_key(self.model, "*")
        held = {}
        async for key in self.redis.scan_iter(match=pattern, count=1000):
            held[key.rsplit(":", 1)[1]] = {int(h) for h in await self.redis.smembers(key)}
        self.held, self._cursor = held, cursor

    async def follow(self) -> None:
        """Forever. Run under `streams.restarting`: after an error it starts over from `load`."""
        self._cursor = None
        await self.load()
        resync_at = asyncio.get_running_loop().time() + RESYNC_S
        while True:
            reply = await self.redis.xread({p.prefix_events_stream(self.model): self._cursor}, count=1000,
                                           block=BLOCK_MS)
            for entry_id, fields in reply[0][1] if reply else []:
                self._cursor = entry_id
                self._apply(p.decode(p.PrefixChange, fields))
            if asyncio.get_running_loop().time() >= resync_at:
                await self.load()
                resync_at = asyncio.get_running_loop().time() + RESYNC_S

    def _apply(self, change: p.PrefixChange) -> None:
        held = set() if change.replace else self.held.setdefault(change.worker_id, set())
        for added, hashes in change.runs:
            (held.update if added else held.difference_update)(hashes)
        self.held[change.worker_id] = held


def _runs(events: list[tuple[bool, int]]) -> list[tuple[bool, list[int]]]:
    """Consecutive events of one kind grouped, order kept (an evict then a re-add must end added)."""
    runs: list[tuple[bool, list[int]]] = []
    for added, block_hash in events:
        if runs and runs[-1][0] == added:
            runs[-1][1].append(block_hash)
        else:
            runs.append((added, [block_hash]))
    return runs
