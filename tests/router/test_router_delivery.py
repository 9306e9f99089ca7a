"""The router's delivery rules, each on its own fresh Redis (the stack's router would take these entries):
a request it cannot route fails alone, is retried, then dead-lettered with its client told; a cache hit is
answered once even when two routers hold the request."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cache.response_cache import CacheLookup, ResponseCache
from router import service as router_service
from router.cache_replay import answer_from_cache
from router.main import consumer_name, is_alive
from router.policy import TierPolicy, TierRule
from router.service import Router
from router.worker_choice import WorkerChooser
from services.base import protocol as p
from services.base import streams
from services.base.redis_client import EmbeddedRedis, connect
from services.base.settings import CacheSettings, StreamSettings
from services.text.model_paths import resolve_model_path
from services.text.prompt_encoder import PromptEncoder


@pytest.fixture
def fresh_redis_url():
    embedded = EmbeddedRedis()
    yield embedded.url
    embedded.close()


async def _until(condition, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _request(prompt: str) -> p.GenerateRequest:
    return p.GenerateRequest(request_id=uuid.uuid4().hex, kind="completion", model="m", prompt=prompt,
                             sampling=p.SamplingOptions(max_tokens=2, temperature=0.0))


class _FailsOnBoom(TierPolicy):
    async def choose(self, request, models, encoder, alive):
        if request.prompt == "boom":
            raise RuntimeError("a bug in one request's routing")
        return await super().choose(request, models, encoder, alive)


def test_a_request_the_router_cannot_route_is_dead_lettered_and_the_others_go_on(fresh_redis_url):
    settings = StreamSettings(claim_idle_ms=0, max_deliveries=2, janitor_interval_s=0.05)
    requests = [_request("first"), _request("boom"), _request("second")]

    async def scenario():
        redis = connect(fresh_redis_url)
        router = Router(redis, _FailsOnBoom(TierRule("s", "l", 10, 10)), WorkerChooser(64, 64),
                        ResponseCache(redis, CacheSettings()), "router-a", settings)
        for request in requests:
            await redis.xadd(p.REQUESTS_STREAM, request.encode())
        stop = asyncio.Event()
        running = asyncio.create_task(router.run(stop))
        await asyncio.sleep(1.5)
        stop.set()
        await running
        forwarded = [p.decode(p.GenerateRequest, f).request_id for _, f in await redis.xrange(p.work_stream("m"))]
        letters = [p.decode(p.DeadLetter, f).request_id for _, f in await redis.xrange(p.DEAD_LETTER_STREAM)]
        replies = [p.decode(p.ReplyChunk, f) for _, f in await redis.xrange(p.reply_stream(requests[1].request_id))]
        pending = (await redis.xpending(p.REQUESTS_STREAM, p.ROUTER_GROUP))["pending"]
        await redis.aclose()
        return forwarded, letters, replies, pending

    forwarded, letters, replies, pending = asyncio.run(scenario())
    assert sorted(forwarded) == sorted([requests[0].request_id, requests[2].request_id])
    assert letters == [requests[1].request_id] and pending == 0
    assert [c.kind for c in replies] == ["error"] and replies[0].error.code == "dead_letter"


class _SlowOnSlow(TierPolicy):
    async def choose(self, request, models, encoder, alive):
        if request.prompt == "slow":
            await asyncio.sleep(3)  # a long prompt's tokenizing, an embedding
        return await super().choose(request, models, encoder, alive)


def test_a_slow_request_does_not_hold_up_the_requests_behind_it(fresh_redis_url):
    slow, *quick = [_request("slow")] + [_request(f"quick {i}") for i in range(5)]

    async def scenario():
        redis = connect(fresh_redis_url)
        router = Router(redis, _SlowOnSlow(TierRule("s", "l", 10, 10)), WorkerChooser(64, 64),
                        ResponseCache(redis, CacheSettings()), "router-a", StreamSettings())
        for request in (slow, *quick):
            await redis.xadd(p.REQUESTS_STREAM, request.encode())
        stop = asyncio.Event()
        running = asyncio.create_task(router.run(stop))
        await asyncio.sleep(1.0)
        early = [p.decode(p.GenerateRequest, f).request_id for _, f in await redis.xrange(p.work_stream("m"))]
        stop.set()
        await running  # the slow one is still forwarded: a stopping router finishes what it read
        late = [p.decode(p.GenerateRequest, f).request_id for _, f in await redis.xrange(p.work_stream("m"))]
        await redis.aclose()
        return early, late

    early, late = asyncio.run(scenario())
    assert sorted(early) == sorted(r.request_id for r in quick)
    assert late[-1] == slow.request_id and len(late) == 6


COMPLETION = p.CachedCompletion(model="m", usage=p.Usage(prompt_tokens=3, completion_tokens=2),
                                choices=[p.CachedChoice(text="hi!", token_ids=[1, 2], finish_reason="length")])


def _cache_hit(request: p.GenerateRequest) -> p.GenerateRequest:
    request.routing = p.RoutingDecision(model="m", reason="named by the request", decided_at=0.0, cache="exact")
    return request


async def _held_by_a_router(redis, request: p.GenerateRequest) -> str:
    """The request's entry, read by router-a (and not yet acknowledged)."""
    await streams.ensure_group(redis, p.REQUESTS_STREAM, p.ROUTER_GROUP)
    entry_id = await redis.xadd(p.REQUESTS_STREAM, request.encode())
    await streams.read_new(redis, p.REQUESTS_STREAM, p.ROUTER_GROUP, "router-a", 1, None)
    return entry_id


def test_a_cache_hit_for_a_cancelled_request_is_not_answered(fresh_redis_url):
    """Its client left while it queued: the router leaves it to a worker, which ends it cancelled."""
    request = _cache_hit(_request("cancelled while queued"))

    async def scenario():
        redis = connect(fresh_redis_url)
        entry_id = await _held_by_a_router(redis, request)
        await redis.set(p.cancel_key(request.request_id), 1)
        answered = await answer_from_cache(redis, entry_id, request, CacheLookup("exact", COMPLETION),
                                           StreamSettings())
        replies, events = await redis.xlen(p.reply_stream(request.request_id)), await redis.xlen(p.EVENTS_STREAM)
        pending = (await redis.xpending(p.REQUESTS_STREAM, p.ROUTER_GROUP))["pending"]
        await redis.aclose()
        return answered, replies, events, pending

    assert asyncio.run(scenario()) == (streams.Outcome.VETOED, 0, 0, 1)  # still the router's, to forward


def test_a_cache_hit_is_answered_once_even_if_two_routers_hold_the_request(fresh_redis_url):
    request = _cache_hit(_request("cached"))

    async def scenario():
        redis = connect(fresh_redis_url)
        entry_id = await _held_by_a_router(redis, request)
        answered = [await answer_from_cache(redis, entry_id, request, CacheLookup("exact", COMPLETION),
                                            StreamSettings()) for _ in ("router-a", "router-b")]
        replies = [p.decode(p.ReplyChunk, f) for _, f in await redis.xrange(p.reply_stream(request.request_id))]
        events = await redis.xlen(p.EVENTS_STREAM)
        await redis.aclose()
        return answered, replies, events

    answered, replies, events = asyncio.run(scenario())
    assert answered == [streams.Outcome.ADDED, streams.Outcome.ACKNOWLEDGED_BEFORE] and events == 1
    assert [c.kind for c in replies] == ["started", "delta", "finished"] and replies[1].text == "hi!"
    assert replies[0].cache == replies[2].cache == "exact"


class _RecordingEncoder(PromptEncoder):
    def __init__(self):
        super().__init__()
        self.warmed: list[str] = []

    def warm(self, model_dir: str) -> bool:
        self.warmed.append(model_dir)
        return super().warm(model_dir)


def test_the_router_loads_tokenizers_before_any_request_needs_them(fresh_redis_url, make_checkpoint, monkeypatch):
    monkeypatch.setattr(router_service, "TOKENIZER_POLL_S", 0.1)
    builtin = str(resolve_model_path("smollm2-135m-instruct"))
    registered = str(make_checkpoint("llama"))

    async def scenario():
        redis = connect(fresh_redis_url)
        encoder = _RecordingEncoder()
        router = Router(redis, TierPolicy(TierRule("smollm2-135m-instruct", "large", 10, 10)), WorkerChooser(64, 64),
                        ResponseCache(redis, CacheSettings()), "router-a", StreamSettings(), encoder=encoder)
        stop = asyncio.Event()
        running = asyncio.create_task(router.run(stop))
        await _until(lambda: builtin in encoder.warmed, 60)  # a tier's built-in model: at start-up
        info = p.ModelInfo(name="large", model_dir=registered, max_model_len=128, kv_block_size=16)
        await redis.hset(p.MODELS_KEY, "large", info.model_dump_json())
        await _until(lambda: registered in encoder.warmed, 60)  # any other: once a worker registers it
        await asyncio.sleep(0.5)
        stop.set()
        await running
        await redis.aclose()
        return encoder

    encoder = asyncio.run(scenario())
    assert encoder.warmed == [builtin, registered]  # each once
    assert encoder.tokenizer(registered, wait=False) is not None  # loaded: no request waits for it


def test_a_running_router_passes_its_healthcheck_and_a_stopped_one_fails_it(fresh_redis_url):
    async def scenario():
        before = await is_alive(fresh_redis_url)
        redis = connect(fresh_redis_url)
        router = Router(redis, TierPolicy(TierRule("s", "l", 10, 10)), WorkerChooser(64, 64),
                        ResponseCache(redis, CacheSettings()), consumer_name(), StreamSettings())
        stop = asyncio.Event()
        running = asyncio.create_task(router.run(stop))
        await asyncio.sleep(1.5)
        during = await is_alive(fresh_redis_url)
        stop.set()
        await running
        await asyncio.sleep(1.2)
        after = await is_alive(fresh_redis_url, within_s=1.0)  # it no longer says so
        await redis.aclose()
        return before, during, after

    assert asyncio.run(scenario()) == (False, True, False)
