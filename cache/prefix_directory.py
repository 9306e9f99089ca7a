"""The prefix directory: which worker holds which KV prefix blocks, kept from the workers' add/evict events.

One Redis set per worker of block hashes (see `gpu_worker/engine/block_hash.py`). A block hash stands for
its whole prefix (the key chains through every parent), so a worker's cached prefix of a prompt is its run
of members from the prompt's first block on. The router asks for all candidate workers in one round trip.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from services import protocol as p

# A worker that stops without cleaning up (killed) leaves its set; it expires unless refreshed.
SET_TTL_S = 60


class PrefixDirectory:
    def __init__(self, redis: aioredis.Redis, model: str):
        self.redis, self.model = redis, model

    def _key(self, worker_id: str) -> str:
        return p.prefix_blocks_key(self.model, worker_id)

    async def apply(self, worker_id: str, events: list[tuple[bool, int]], snapshot: list[int] | None) -> None:
        """A worker's events since its last call, in order; `snapshot` (all it holds) replaces the set."""
        key = self._key(worker_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            if snapshot is not None:
                pipe.delete(key)
                events = [(True, h) for h in snapshot]
            for run in _runs(events):
                added, hashes = run
                (pipe.sadd if added else pipe.srem)(key, *hashes)
            pipe.expire(key, SET_TTL_S)
            await pipe.execute()

    async def forget(self, worker_id: str) -> None:
        await self.redis.delete(self._key(worker_id))

    async def cached_blocks(self, block_hashes: list[int], workers: list[str]) -> dict[str, int]:
        """For each worker: how many of the prompt's leading blocks it holds."""
        if not block_hashes or not workers:
            return dict.fromkeys(workers, 0)
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker in workers:
                pipe.smismember(self._key(worker), block_hashes)
            replies = await pipe.execute()
        return {worker: _leading_run(held) for worker, held in zip(workers, replies, strict=True)}


def _runs(events: list[tuple[bool, int]]) -> list[tuple[bool, list[int]]]:
    """Consecutive events of one kind grouped, order kept (an evict then a re-add must end added)."""
    runs: list[tuple[bool, list[int]]] = []
    for added, block_hash in events:
        if runs and runs[-1][0] == added:
            runs[-1][1].append(block_hash)
        else:
            runs.append((added, [block_hash]))
    return runs


def _leading_run(held: list) -> int:
    count = 0
    for member in held:
        if not int(member):
            break
        count += 1
    return count
