"""Who runs a batch, and what happens when its job dies.

Celery acknowledges a batch job when it ends (`task_acks_late`), so a job whose worker was killed is delivered
again, but only after the broker's visibility timeout (an hour on Redis, and it must stay longer than the longest
job, or a running job would be delivered twice). A job therefore holds a lease on its batch: a key with a short
TTL that it refreshes while it runs (`BatchLease.hold`). A job that finds the lease held by another runs
nothing. The sweep (`sweep`, a beat job every TOKENFLEET_ACCOUNTING_BATCH_SWEEP_INTERVAL_S) sends a new job for
every batch that a job had started (`in_progress` or `cancelling`) whose lease has lapsed: its job died, and the
new one answers the lines left (the job is idempotent, see batch_jobs.py). A batch still `validating` is sent
again only once it is older than TOKENFLEET_ACCOUNTING_BATCH_REQUEUE_AFTER_S: until then its message is taken to
be in Celery's queue (behind longer jobs a duplicate may follow; it finds the batch done and runs nothing).

The sweep also expires what is past its window (`expire_if_due`), so a batch whose tenant never reads it again
still ends on time, and forgets batches that are final or gone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis

from services.base import protocol as p
from services.base.redis_client import as_text
from services.batch.store import FINAL, RESENT_FIELD, expire_if_due, load_batch, transition

log = logging.getLogger(__name__)
T = TypeVar("T")
QUEUED = "queued"  # the lease's value while a job the sweep sent waits in the queue; any job may take it
# A batch whose job keeps dying (a line that crashes it, a bug) fails after this many jobs sent by the sweep,
# rather than being retried every sweep until its window ends. Counted in the batch record's RESENT_FIELD.
MAX_RESENDS = 5
# Taken when free or only queued; renewed only by its holder, or re-taken when it lapsed and nobody took it.
_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[2] and holder ~= ARGV[3] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[1])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class BatchLease:
    """A job's claim on one batch, `ttl_s` long and renewed every third of it while the job runs."""

    def __init__(self, redis: aioredis.Redis, batch_id: str, ttl_s: float):
        self.redis, self.batch_id, self.ttl_s = redis, batch_id, ttl_s
        self.key, self.token = p.batch_lease_key(batch_id), uuid.uuid4().hex

    async def _take(self, *also_free: str) -> bool:
        """Holds the lease unless another job does (`also_free`: values that count as free)."""
        return bool(await self.redis.eval(_ACQUIRE, 1, self.key, int(self.ttl_s * 1000), self.token,
                                          *(also_free or (self.token,))))

    async def hold(self, work: Callable[[], Awaitable[T]]) -> T | None:
        """`work`'s result, run while holding the lease; None, without running it, when another job holds the
        lease, or cut short when another job took the lease over (this one stalled past its TTL, e.g. through a
        Redis outage): then the other job carries on from what this one recorded."""
        if not await self._take(QUEUED):
            log.info("batch %s is run by another job", self.batch_id)
            return None
        task = asyncio.ensure_future(work())
        try:
            while not (await asyncio.wait([task], timeout=self.ttl_s / 3))[0]:
                try:
                    if not await self._take():
                        log.warning("batch %s was taken over by another job; this one stops", self.batch_id)
                        return None
                except aioredis.RedisError as exc:  # the lease may lapse; the next renewal tells
                    log.warning("could not renew the lease on batch %s: %s", self.batch_id, exc)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            with contextlib.suppress(aioredis.RedisError):  # else it lapses by itself
                await self.redis.eval(_RELEASE, 1, self.key, self.token)


def _orphaned(batch: dict, requeue_after_s: float) -> bool:
    """Started by a job (which holds no lease: it died), or never started long after its creation (its job
    failed before it began, and Celery acknowledged the failure)."""
    return batch["status"] in ("in_progress", "cancelling") or (
        batch["status"] == "validating" and batch["created_at"] < time.time() - requeue_after_s)


async def sweep(redis: aioredis.Redis, submit: Callable[[str], object], requeue_after_s: float) -> list[str]:
    """Sends a job (`submit(batch_id)`) for each started batch whose job died; returns their ids. A job sent
    stays `queued` for `requeue_after_s` (how long it may wait in Celery's queue) before being sent again."""
    sent = []
    for batch_id in [as_text(i) for i in await redis.zrange(p.ACTIVE_BATCHES_KEY, 0, -1)]:
        batch = await load_batch(redis, batch_id)
        if batch is not None:
            batch = await expire_if_due(redis, batch)
        if batch is None or batch["status"] in FINAL:
            await redis.zrem(p.ACTIVE_BATCHES_KEY, batch_id)
        elif _orphaned(batch, requeue_after_s) and await redis.set(
                p.batch_lease_key(batch_id), QUEUED, nx=True, px=int(requeue_after_s * 1000)):
            if await redis.hincrby(p.batch_key(batch_id), RESENT_FIELD, 1) > MAX_RESENDS:
                log.error("batch %s: its job died %d times; the batch fails", batch_id, MAX_RESENDS)
                await transition(redis, batch_id, ("validating", "in_progress", "cancelling"), status="failed",
                                 failed_at=int(time.time()),
                                 errors={"object": "list", "data": [{"code": "job_failed", "line": None, "message":
                                         f"the batch's job failed {MAX_RESENDS} times in a row; see the Celery "
                                         "worker's log"}]})
                continue
            log.warning("batch %s has no live job (its worker died); sending another", batch_id)
            submit(batch_id)
            sent.append(batch_id)
    return sent
