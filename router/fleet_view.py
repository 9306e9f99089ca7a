"""The live workers of a model and their loads: what each reported in its last heartbeat, plus what this
router sent it since (heartbeats come every half second; at tens of requests a second the router's own
recent sends are most of the difference)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque

import redis.asyncio as aioredis

from router.worker_choice import WorkerLoad
from services.base import protocol as p


class FleetView:
    def __init__(self, redis: aioredis.Redis, refresh_s: float = 0.1):
        self.redis, self.refresh_s = redis, refresh_s
        self._sent: dict[str, deque[float]] = defaultdict(deque)  # worker id -> times this router sent it work
        # model -> its workers' last heartbeats, re-read in the background (`follow`): a decision reads memory,
        # never waits on Redis (heartbeats change twice a second, decisions come far more often).
        self._statuses: dict[str, list[p.WorkerStatus]] = {}

    async def workers(self, model: str) -> list[WorkerLoad]:
        """Live, not draining, in a stable order. The first call for a model reads Redis; `follow` the rest."""
        if model not in self._statuses:
            self._statuses[model] = await self._read(model)
        return [WorkerLoad(s.worker_id, s.inflight + s.backlog + self._sent_since(s.worker_id, s.updated_at))
                for s in self._statuses[model]]

    async def follow(self) -> None:
        """Forever: re-reads the heartbeats of every model asked about so far."""
        while True:
            await asyncio.sleep(self.refresh_s)
            for model in list(self._statuses):
                self._statuses[model] = await self._read(model)
            live = {s.worker_id for statuses in self._statuses.values() for s in statuses}
            for gone in self._sent.keys() - live:  # a restarted worker comes back under a new id
                del self._sent[gone]

    async def _read(self, model: str) -> list[p.WorkerStatus]:
        ids = sorted(await self.redis.zrangebyscore(p.workers_key(model), time.time(), "+inf"))
        if not ids:
            return []
        raws = await self.redis.mget([p.heartbeat_key(model, w) for w in ids])
        statuses = [p.WorkerStatus.model_validate_json(raw) for raw in raws if raw is not None]
        return [s for s in statuses if not s.draining]

    def sent(self, worker_id: str) -> None:
        self._sent[worker_id].append(time.time())

    def _sent_since(self, worker_id: str, reported_at: float) -> int:
        sent = self._sent.get(worker_id)
        if not sent:
            return 0
        while sent and sent[0] <= reported_at:  # already in the worker's own count
            sent.popleft()
        return len(sent)
