"""The prefix directory on a real Redis, fed with a real engine's add/evict events, and the inboxes of
workers that are gone: served by the live ones, then deleted."""

from __future__ import annotations

import asyncio
import uuid

from cache.prefix_directory import PrefixDirectory, PrefixIndex
from gpu_worker.orphan_inboxes import OrphanInboxes
from services.base import protocol as p
from services.base import streams
from services.base.redis_client import connect
from services.base.settings import StreamSettings
from services.text.block_hash import block_hashes

BS = 4


def _directory_scenario(redis_url, body):
    """`body(directory, index)`: a worker-side directory and a router-side index of one fresh model."""
    async def scenario():
        redis = connect(redis_url)
        model = f"model-{uuid.uuid4().hex}"
        try:
            return await body(PrefixDirectory(redis, model), PrefixIndex(redis, model))
        finally:
            await redis.aclose()

    return asyncio.run(scenario())


def test_the_directory_tells_each_workers_longest_cached_prefix_of_a_prompt(redis_url):
    hashes = block_hashes(list(range(20)), BS)

    async def body(directory, index):
        await directory.apply("a", [(True, h) for h in hashes[:2]], None)
        await directory.apply("b", [(True, h) for h in hashes], None)
        await directory.apply("c", [(True, hashes[1])], None)  # a block without its first one: no prefix
        await index.load()
        return index.cached_blocks(hashes, ["a", "b", "c", "d"])

    assert _directory_scenario(redis_url, body) == {"a": 2, "b": 5, "c": 0, "d": 0}


def test_an_evicted_block_ends_the_prefix_there_and_a_snapshot_replaces_everything(redis_url):
    hashes = block_hashes(list(range(16)), BS)

    async def body(directory, index):
        await directory.apply("a", [(True, h) for h in hashes] + [(False, hashes[2])], None)
        await index.load()
        after_evict = index.cached_blocks(hashes, ["a"])["a"]
        await directory.apply("a", [], [hashes[0]])
        await index.load()
        return after_evict, index.cached_blocks(hashes, ["a"])["a"]

    assert _directory_scenario(redis_url, body) == (2, 1)


def test_a_router_index_follows_changes_made_after_it_loaded(redis_url):
    hashes = block_hashes(list(range(16)), BS)

    async def body(directory, index):
        await directory.apply("a", [(True, h) for h in hashes], None)
        follower = asyncio.create_task(index.follow())
        await asyncio.sleep(0.2)
        await directory.apply("a", [(False, hashes[1])], None)
        await directory.apply("b", [(True, h) for h in hashes[:3]], None)
        await directory.forget("c")
        await asyncio.sleep(0.3)
        seen = index.cached_blocks(hashes, ["a", "b"])
        await directory.forget("b")  # a worker that restarted or drained holds nothing
        await asyncio.sleep(0.3)
        follower.cancel()
        return seen, index.cached_blocks(hashes, ["b"])

    assert _directory_scenario(redis_url, body) == ({"a": 1, "b": 3}, {"b": 0})


def test_a_salted_prompt_is_not_found_under_the_unsalted_blocks(redis_url):
    prompt = list(range(16))

    async def body(directory, index):
        await directory.apply("a", [(True, h) for h in block_hashes(prompt, BS)], None)
        await index.load()
        return index.cached_blocks(block_hashes(prompt, BS, "tenant-b"), ["a"])

    assert _directory_scenario(redis_url, body) == {"a": 0}


def test_a_dead_workers_inbox_is_served_by_a_live_worker_and_then_deleted(redis_url):
    model = f"model-{uuid.uuid4().hex}"
    settings = StreamSettings(claim_idle_ms=0)
    requests = [p.GenerateRequest(request_id=uuid.uuid4().hex, kind="completion", model=model, prompt="hi",
                                  sampling=p.SamplingOptions()) for _ in range(3)]

    async def scenario():
        redis = connect(redis_url)
        inbox = p.inbox_stream(model, "dead")
        await streams.ensure_group(redis, inbox, p.WORKER_GROUP)
        await redis.sadd(p.inboxes_key(model), "dead")
        for request in requests:
            await redis.xadd(inbox, request.encode())
        await streams.read_new(redis, inbox, p.WORKER_GROUP, "dead", 1, None)  # it took one, then died
        orphans = OrphanInboxes(redis, model, "live", settings, PrefixDirectory(redis, model))
        taken = await orphans.take(10)
        for delivery in taken:
            await redis.xack(delivery.stream, p.WORKER_GROUP, delivery.entry_id)
        again = await orphans.take(10)  # nothing left: the inbox goes
        state = await redis.exists(inbox), await redis.smembers(p.inboxes_key(model))
        await redis.aclose()
        return taken, again, state

    taken, again, (exists, registered) = asyncio.run(scenario())
    assert sorted(p.decode(p.GenerateRequest, d.fields).request_id for d in taken) == sorted(
        r.request_id for r in requests)
    assert [d.claimed for d in taken].count(True) == 1  # the one it had started is resumed, not restarted
    assert again == [] and not exists and registered == set()


def _other_worker_inbox(redis_url, draining: bool) -> tuple[int, int]:
    """(entries a live worker takes, entries left) from the inbox of another worker that is alive."""
    model = f"model-{uuid.uuid4().hex}"
    status = p.WorkerStatus(worker_id="busy", model=model, running=1, waiting=0, kv_blocks_used=0,
                            kv_blocks_total=1, draining=draining, updated_at=0)

    async def scenario():
        redis = connect(redis_url)
        inbox = p.inbox_stream(model, "busy")
        await streams.ensure_group(redis, inbox, p.WORKER_GROUP)
        await redis.sadd(p.inboxes_key(model), "busy")
        await redis.set(p.heartbeat_key(model, "busy"), status.model_dump_json(), px=5000)
        await redis.xadd(inbox, {p.FIELD: "{}"})
        taken = await OrphanInboxes(redis, model, "live", StreamSettings(), PrefixDirectory(redis, model)).take(10)
        unread = await streams.unread(redis, inbox, p.WORKER_GROUP)
        await redis.delete(inbox, p.heartbeat_key(model, "busy"), p.inboxes_key(model))
        await redis.aclose()
        return len(taken), unread

    return asyncio.run(scenario())


def test_a_live_workers_inbox_is_left_alone(redis_url):
    assert _other_worker_inbox(redis_url, draining=False) == (0, 1)


def test_a_draining_workers_unread_inbox_is_taken_at_once(redis_url):
    assert _other_worker_inbox(redis_url, draining=True) == (1, 0)
