"""The live workers of a model and their loads: what each reported in its last heartbeat, plus what this
router sent it since (heartbeats come every half second; at tens of requests a second the router's own
recent sends are most of the difference)."""

from __future__ import annotations

import time
from collections import defaultdict, deque

import redis.asyncio as aioredis

from router.worker_choice import WorkerLoad
from services import protocol as p


class FleetView:
    def __init__(self, redis: aioredis.Redis):
        self.redis = redis
        self._sent: dict[str, deque[float]] = defaultdict(deque)  # worker id -> times this router sent it work

    async def workers(self, model: str) -> list[WorkerLoad]:
        """Live, not draining, in a stable order."""
        ids = sorted(await self.redis.zrangebyscore(p.workers_key(model), time.time(), "+inf"))
        if not ids:
            return []
        loads = []
        for worker_id, raw in zip(ids, await self.redis.mget([p.heartbeat_key(model, w) for w in ids]), strict=True):
            if raw is None:
                continue
            status = p.WorkerStatus.model_validate_json(raw)
            if not status.draining:
                loads.append(WorkerLoad(worker_id, status.inflight + self._sent_since(worker_id, status.updated_at)))
        return loads

    def sent(self, worker_id: str) -> None:
        self._sent[worker_id].append(time.time())

    def _sent_since(self, worker_id: str, reported_at: float) -> int:
        sent = self._sent.get(worker_id)
        if not sent:
            return 0
        while sent and sent[0] <= reported_at:  # already in the worker's own count
            sent.popleft()
        return len(sent)
