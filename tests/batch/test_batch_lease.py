"""A batch job's lease and the sweep that replaces a dead job, on a real Redis: one job per batch at a time, a
started batch whose job died is sent again (once while that job waits), a job that lost its lease stops."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid

from services.base import protocol as p
from services.base.redis_client import connect
from services.batch.lease import MAX_RESENDS, QUEUED, BatchLease, sweep
from services.batch.store import load_batch


def _batch_record(status: str, expires_in_s: float = 3600) -> dict:
    now = int(time.time())
    return {"id": f"batch_{uuid.uuid4().hex}", "status": status, "input_file_id": "file-gone", "created_at": now,
            "expires_at": now + expires_in_s, "finalizing_at": None, "expired_at": None, "tenant": "t",
            "request_counts": {"total": 1, "completed": 0, "failed": 0}}


async def _store(redis, batch: dict) -> str:
    await redis.hset(p.batch_key(batch["id"]), mapping={k: json.dumps(v) for k, v in batch.items()})
    await redis.zadd(p.ACTIVE_BATCHES_KEY, {batch["id"]: time.time()})
    return batch["id"]


def test_a_job_runs_nothing_while_another_job_holds_the_batch(redis_url):
    async def main():
        redis = connect(redis_url)
        batch_id, ran = f"batch_{uuid.uuid4().hex}", []

        async def work(name):
            ran.append(name)
            await asyncio.sleep(0.3)
            return name

        both = await asyncio.gather(*(BatchLease(redis, batch_id, ttl_s=5).hold(functools.partial(work, name))
                                      for name in ("a", "b")))
        after = await BatchLease(redis, batch_id, ttl_s=5).hold(functools.partial(work, "c"))
        await redis.aclose()
        return both, after, ran

    both, after, ran = asyncio.run(main())
    assert None in both and ran == [name for name in both if name] + ["c"]
    assert after == "c"  # free again once the first job ended


def test_a_running_job_keeps_its_lease_past_its_ttl(redis_url):
    async def main():
        redis = connect(redis_url)
        batch_id = f"batch_{uuid.uuid4().hex}"
        holder = asyncio.ensure_future(BatchLease(redis, batch_id, ttl_s=0.3).hold(
            lambda: asyncio.sleep(1.2, "done")))
        await asyncio.sleep(0.9)  # three TTLs in: renewed, so still held
        other = await BatchLease(redis, batch_id, ttl_s=0.3).hold(lambda: asyncio.sleep(0, "other"))
        result = await holder
        left = await redis.exists(p.batch_lease_key(batch_id))
        await redis.aclose()
        return other, result, left

    assert asyncio.run(main()) == (None, "done", 0)  # and released at its end


def test_a_job_whose_lease_was_taken_over_stops(redis_url):
    async def main():
        redis = connect(redis_url)
        batch_id, finished = f"batch_{uuid.uuid4().hex}", []

        async def work():
            await asyncio.sleep(2)
            finished.append(True)

        holder = asyncio.ensure_future(BatchLease(redis, batch_id, ttl_s=0.3).hold(work))
        await asyncio.sleep(0.05)
        await redis.set(p.batch_lease_key(batch_id), QUEUED)  # the sweep judged it dead and sent another job
        result = await asyncio.wait_for(holder, 1.5)
        await redis.aclose()
        return result, finished

    assert asyncio.run(main()) == (None, [])


def test_the_sweep_sends_a_job_for_a_started_batch_whose_job_died_once_until_it_starts(redis_url):
    async def main():
        redis = connect(redis_url)
        dead = await _store(redis, _batch_record("in_progress"))
        cancelling = await _store(redis, _batch_record("cancelling"))
        alive = await _store(redis, _batch_record("in_progress"))
        await redis.set(p.batch_lease_key(alive), "a-live-job", px=10_000)
        sent = []
        first = await sweep(redis, sent.append, requeue_after_s=0.5)
        again = await sweep(redis, sent.append, requeue_after_s=0.5)
        await asyncio.sleep(0.6)  # the job sent for `dead` never started
        later = await sweep(redis, sent.append, requeue_after_s=0.5)
        await redis.aclose()
        return (dead, cancelling, alive), first, again, later, sent

    (dead, cancelling, alive), first, again, later, sent = asyncio.run(main())
    mine = {dead, cancelling, alive}
    assert {b for b in first if b in mine} == {dead, cancelling}
    assert not {b for b in again if b in mine}
    assert {b for b in later if b in mine} == {dead, cancelling}
    assert sent.count(dead) == 2 and alive not in sent


def test_the_sweep_sends_a_job_for_a_batch_never_started_long_after_its_creation_only(redis_url):
    async def main():
        redis = connect(redis_url)
        queued = await _store(redis, _batch_record("validating"))  # its message waits in Celery's queue
        stale = _batch_record("validating")
        stale["created_at"] -= 120  # its job failed before starting it, and Celery acknowledged the failure
        stale = await _store(redis, stale)
        sent = await sweep(redis, lambda _: None, requeue_after_s=60)
        await redis.aclose()
        return queued, stale, sent

    queued, stale, sent = asyncio.run(main())
    assert stale in sent and queued not in sent


def test_the_sweep_forgets_final_and_gone_batches_and_expires_overdue_ones(redis_url):
    async def main():
        redis = connect(redis_url)
        done = await _store(redis, _batch_record("completed"))
        gone = f"batch_{uuid.uuid4().hex}"
        await redis.zadd(p.ACTIVE_BATCHES_KEY, {gone: time.time()})
        overdue = await _store(redis, _batch_record("in_progress", expires_in_s=-1))
        sent = await sweep(redis, lambda _: None, requeue_after_s=60)
        members = {m.decode() if isinstance(m, bytes) else m for m in await redis.zrange(p.ACTIVE_BATCHES_KEY, 0, -1)}
        status = json.loads(await redis.hget(p.batch_key(overdue), "status"))
        await redis.aclose()
        return (done, gone, overdue), sent, members, status

    (done, gone, overdue), sent, members, status = asyncio.run(main())
    assert status == "expired" and overdue not in sent
    assert not members & {done, gone}


def test_a_batch_whose_job_keeps_dying_fails_after_max_resends_instead_of_retrying_forever(redis_url):
    async def main():
        redis = connect(redis_url)
        doomed = await _store(redis, _batch_record("in_progress"))
        sends = []
        for _ in range(MAX_RESENDS + 1):  # each job sent dies at once: its lease lapses before the next sweep
            sends += [b for b in await sweep(redis, lambda _: None, requeue_after_s=60)
                      if b == doomed]
            await redis.delete(p.batch_lease_key(doomed))
        batch = await load_batch(redis, doomed)
        await redis.aclose()
        return len(sends), batch

    sends, batch = asyncio.run(main())
    assert sends == MAX_RESENDS and batch["status"] == "failed"
    assert batch["errors"]["data"][0]["code"] == "job_failed"
