"""Admission on a real Redis: the queue-depth bound holds however many requests (and gateways) arrive at
once, `auto` counts against the tiers it may land on, and a max_tokens no model context can hold is a 400."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from gateway.admission import Admission
from gateway.schemas import RequestError
from services import protocol as p
from services.redis_client import connect
from services.settings import GatewaySettings, RouterSettings

DEPTH = 4


def _run(redis_url: str, scenario):
    async def go():
        redis = connect(redis_url)
        small, large = f"small-{uuid.uuid4().hex[:8]}", f"large-{uuid.uuid4().hex[:8]}"
        try:
            for name in (small, large):  # served, with a live worker
                await redis.hset(p.MODELS_KEY, name, p.ModelInfo(name=name, model_dir="/m", max_model_len=2048)
                                 .model_dump_json())
                await redis.zadd(p.workers_key(name), {"w": time.time() + 60})
            return await scenario(redis, small, large)
        finally:
            await redis.hdel(p.MODELS_KEY, small, large)
            await redis.aclose()

    return asyncio.run(go())


def _admission(redis, small: str, large: str, max_events_backlog: int = 10**9) -> Admission:
    """One gateway's admission (several instances stand for several gateways)."""
    return Admission(redis, GatewaySettings(max_queue_depth=DEPTH), RouterSettings(small_model=small,
                                                                                     large_model=large),
                     max_events_backlog)


async def _outcome(admission: Admission, model: str, **kwargs) -> str:
    try:
        await admission.admit(model, uuid.uuid4().hex, **kwargs)
    except RequestError as exc:
        return exc.error.code
    return "admitted"


def test_forty_parallel_requests_from_four_gateways_admit_exactly_the_queue_depth(redis_url):
    async def scenario(redis, small, large):
        gateways = [_admission(redis, small, large) for _ in range(4)]
        return await asyncio.gather(*(_outcome(gateways[i % 4], small) for i in range(40)))

    outcomes = _run(redis_url, scenario)
    assert outcomes.count("admitted") == DEPTH and outcomes.count("queue_full") == 40 - DEPTH


def test_auto_requests_count_against_both_tiers_queues(redis_url):
    async def scenario(redis, small, large):
        admission = _admission(redis, small, large)
        autos = [await _outcome(admission, p.AUTO_MODEL) for _ in range(DEPTH)]
        return autos, await _outcome(admission, small), await _outcome(admission, large)

    autos, small_after, large_after = _run(redis_url, scenario)
    assert autos == ["admitted"] * DEPTH and small_after == large_after == "queue_full"


def test_a_released_request_frees_its_place_in_every_queue_it_took(redis_url):
    async def scenario(redis, small, large):
        admission, rid = _admission(redis, small, large), uuid.uuid4().hex
        await admission.admit(p.AUTO_MODEL, rid)
        for _ in range(DEPTH - 1):
            await _outcome(admission, small)
        full = await _outcome(admission, small)
        await admission.release(p.AUTO_MODEL, rid)
        return full, await _outcome(admission, small)

    assert _run(redis_url, scenario) == ("queue_full", "admitted")


@pytest.mark.parametrize(("max_tokens", "outcome"), [(2048, "invalid_value"), (10**9, "invalid_value"),
                                                     (2047, "admitted")])
def test_max_tokens_must_leave_room_for_a_prompt_in_the_models_context(redis_url, max_tokens, outcome):
    async def scenario(redis, small, large):
        return await _outcome(_admission(redis, small, large), small, max_tokens=max_tokens)

    assert _run(redis_url, scenario) == outcome


def test_work_is_refused_with_503_while_unrecorded_completion_events_exceed_their_bound(redis_url):
    async def scenario(redis, small, large):
        backlog = await redis.xlen(p.EVENTS_STREAM)
        return (await _outcome(_admission(redis, small, large, max_events_backlog=backlog + 1), small),
                await _outcome(_admission(redis, small, large, max_events_backlog=backlog), small))

    assert _run(redis_url, scenario) == ("admitted", "accounting_backlog")
