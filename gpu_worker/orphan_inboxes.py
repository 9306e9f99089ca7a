"""Inboxes whose worker is gone (killed, or drained and stopped): any live worker of the model with room
serves what is left in them, and deletes an inbox once it is empty. A draining worker's inbox is read too
(what it will not read any more), but not claimed from nor deleted: it still finishes what it holds.

The router sends each request to one chosen worker's inbox (its cache holds the prompt's prefix). A dead
worker's inbox may hold entries it had taken and not finished (pending, claimed once idle past
`claim_idle_ms`, resumed from their reply streams) and entries it never read (taken at once).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from cache.prefix_directory import PrefixDirectory
from services.base import protocol as p
from services.base import streams
from services.base.settings import StreamSettings


class OrphanInboxes:
    def __init__(self, redis: aioredis.Redis, model: str, worker_id: str, settings: StreamSettings,
                 directory: PrefixDirectory):
        self.redis, self.model, self.worker_id, self.settings = redis, model, worker_id, settings
        self.directory = directory
        self._claimers: dict[str, streams.StaleClaimer] = {}

    async def take(self, count: int) -> list[streams.Delivery]:
        taken: list[streams.Delivery] = []
        for owner in await self.redis.smembers(p.inboxes_key(self.model)):
            if len(taken) >= count:
                break
            if owner == self.worker_id:
                continue
            heartbeat = await self.redis.get(p.heartbeat_key(self.model, owner))
            if heartbeat is None:
                taken += await self._take_from(owner, count - len(taken))
            elif p.WorkerStatus.model_validate_json(heartbeat).draining:
                taken += await streams.read_new(self.redis, p.inbox_stream(self.model, owner), p.WORKER_GROUP,
                                                self.worker_id, count - len(taken), None)
        return taken

    async def _take_from(self, owner: str, count: int) -> list[streams.Delivery]:
        stream = p.inbox_stream(self.model, owner)
        await streams.ensure_group(self.redis, stream, p.WORKER_GROUP)
        claimer = self._claimers.setdefault(
            stream, streams.StaleClaimer(self.redis, stream, p.WORKER_GROUP, self.worker_id, self.settings))
        got = await claimer.claim(count)
        if len(got) < count:
            got += await streams.read_new(self.redis, stream, p.WORKER_GROUP, self.worker_id, count - len(got), None)
        if not got and await streams.retire(self.redis, stream, p.WORKER_GROUP, p.inboxes_key(self.model), owner):
            self._claimers.pop(stream, None)
            await self.directory.forget(owner)
        return got
