"""A cancelled task stops, even when its cancellation lands as a Redis call it awaits completes (Python 3.11's
`asyncio.wait_for`, under which redis-py sends every command, lost such cancellations); and a shutdown that
cancels tasks goes on without one that does not stop, saying where it is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import pytest
import redis.asyncio as aioredis

from services.base.asyncio_tasks import cancel_and_wait, keep_cancellations


@pytest.fixture(autouse=True)
def cancellations_kept():
    original = asyncio.wait_for
    keep_cancellations()
    yield
    asyncio.wait_for = original


def test_a_cancel_landing_as_the_awaited_call_completes_reaches_the_caller():
    async def main():
        call = asyncio.get_running_loop().create_future()

        async def caller():
            await asyncio.wait_for(call, 5)
            return "went on"

        task = asyncio.create_task(caller())
        await asyncio.sleep(0)
        call.set_result(None)  # the call completes and the task is cancelled in one pass
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_wait_for_still_times_out_and_returns_results():
    async def main():
        assert await asyncio.wait_for(asyncio.sleep(0, "done"), 5) == "done"
        assert await asyncio.wait_for(asyncio.sleep(0, "no limit"), None) == "no limit"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(5), 0.01)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(5), 0)

    asyncio.run(main())


def test_a_loop_of_redis_calls_stops_whenever_it_is_cancelled(redis_url):
    async def main():
        redis = aioredis.from_url(redis_url, decode_responses=True, socket_timeout=5)
        runaway = False  # what ends a loop that lost its cancellation, so that the test itself ends

        async def loop():
            while not runaway:
                await redis.get("tokenfleet-test:nothing")
                await redis.smembers("tokenfleet-test:nothing")

        lost = 0
        rng = random.Random(7)
        for _ in range(60):
            task = asyncio.create_task(loop())
            await asyncio.sleep(rng.random() * 0.003)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=2)
            if not done:
                lost += 1
                runaway = True
                await asyncio.wait([task])
                runaway = False
        await redis.aclose()
        return lost

    assert asyncio.run(main()) == 0


def test_a_task_that_ignores_its_cancellation_is_left_behind_and_logged_with_where_it_waits(caplog):
    async def main():
        async def obeys():
            await asyncio.sleep(60)

        released = asyncio.Event()

        async def waiting_past_a_lost_cancellation():
            while not released.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(obeys(), name="obeys"),
                 asyncio.create_task(waiting_past_a_lost_cancellation(), name="stubborn")]
        await asyncio.sleep(0)
        stuck = await cancel_and_wait(tasks, 0.2, logging.getLogger("shutdown"), "shutting down")
        assert [task.get_name() for task in stuck] == ["stubborn"]
        assert tasks[0].cancelled()
        released.set()  # the test does not leave it running
        await asyncio.wait(stuck)

    asyncio.run(main())
    assert "task stubborn did not end within 0.2 s" in caplog.text
    assert "in waiting_past_a_lost_cancellation" in caplog.text
