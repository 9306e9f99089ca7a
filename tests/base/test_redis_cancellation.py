"""Every service stops by cancelling its loops, most of them waiting on a Redis command at that moment. The Redis
client must let such a cancellation through (redis-py 8.x swallowed most of them: the loop went on, and its
service never stopped)."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.base.redis_client import EmbeddedRedis, connect


@pytest.fixture
def fresh_redis_url():
    embedded = EmbeddedRedis()
    yield embedded.url
    embedded.close()


def test_a_task_cancelled_during_a_redis_command_ends(fresh_redis_url):
    async def scenario() -> list[int]:
        redis = connect(fresh_redis_url)

        async def polls_forever():
            while True:
                await redis.zrangebyscore("workers", 0, "+inf")

        went_on = []
        for attempt in range(60):  # cancels land at random points of a command: sent, awaited, parsed
            if len(went_on) == 3:
                break
            task = asyncio.create_task(polls_forever())
            await asyncio.sleep(random.random() * 0.003)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=1.0)
            if not done:
                went_on.append(attempt)
                task.cancel()
                await asyncio.wait([task], timeout=1.0)
        await redis.aclose()
        return went_on

    assert asyncio.run(scenario()) == []
