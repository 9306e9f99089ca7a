"""The exact response cache and the rules of the front both caches share, on a real Redis."""

from __future__ import annotations

import asyncio
import uuid

from cache.response_cache import ResponseCache
from cache.semantic_cache import SemanticCache
from services.base import protocol as p
from services.base.redis_client import connect
from services.base.settings import CacheSettings


def _request(tenant: str, mode: str = "exact", **sampling) -> p.GenerateRequest:
    return p.GenerateRequest(request_id=uuid.uuid4().hex, kind="chat", model="m", api_key_name=tenant,
                             messages=[{"role": "user", "content": "What is a cache?"}], cache_mode=mode,
                             sampling=p.SamplingOptions(**{"temperature": 0.0, "max_tokens": 4, **sampling}))


def _completion(finish_reason: str = "stop", tokens: int = 2) -> p.CachedCompletion:
    return p.CachedCompletion(model="m", max_tokens=4, usage=p.Usage(prompt_tokens=5, completion_tokens=tokens),
                              choices=[p.CachedChoice(text="a store", token_ids=list(range(tokens)),
                                                      finish_reason=finish_reason)])


def _run(redis_url, body, embedder=None, **settings):
    async def scenario():
        redis = connect(redis_url)
        try:
            config = CacheSettings(**settings)
            return await body(ResponseCache(redis, config, SemanticCache(redis, config, embedder)))
        finally:
            await redis.aclose()

    return asyncio.run(scenario())


def test_an_exact_entry_answers_the_same_request_until_its_ttl_runs_out(redis_url):
    tenant = f"t-{uuid.uuid4().hex}"

    async def body(cache):
        miss = await cache.lookup(_request(tenant), "m")
        await cache.store(miss.fill, _completion())
        hit = await cache.lookup(_request(tenant), "m")
        await asyncio.sleep(1.2)
        expired = await cache.lookup(_request(tenant), "m")
        return miss.result, hit.result, hit.completion.choices[0].text, expired.result

    assert _run(redis_url, body, exact_ttl_s=1) == ("miss", "exact", "a store", "miss")


def test_exact_entries_are_kept_per_tenant_and_per_model(redis_url):
    tenant = f"t-{uuid.uuid4().hex}"

    async def body(cache):
        await cache.store((await cache.lookup(_request(tenant), "m")).fill, _completion())
        return ((await cache.lookup(_request(tenant + "-other"), "m")).result,
                (await cache.lookup(_request(tenant), "other-model")).result)

    assert _run(redis_url, body) == ("miss", "miss")


def test_nothing_is_looked_up_or_filled_when_the_cache_is_off_or_the_request_is_not_deterministic(redis_url):
    tenant = f"t-{uuid.uuid4().hex}"

    async def body(cache):
        off = await cache.lookup(_request(tenant, mode="off"), "m")
        sampled = await cache.lookup(_request(tenant, temperature=0.7), "m")
        with_logprobs = await cache.lookup(_request(tenant, logprobs=2), "m")
        return off.result, (sampled.result, sampled.fill), (with_logprobs.result, with_logprobs.fill)

    assert _run(redis_url, body) == (None, ("miss", None), ("miss", None))


def test_a_seeded_sampled_request_is_deterministic_and_cached(redis_url):
    tenant = f"t-{uuid.uuid4().hex}"

    async def body(cache):
        await cache.store((await cache.lookup(_request(tenant, temperature=0.7, seed=3), "m")).fill, _completion())
        return (await cache.lookup(_request(tenant, temperature=0.7, seed=3), "m")).result

    assert _run(redis_url, body) == "exact"


def test_a_semantic_answer_cut_off_by_max_tokens_serves_only_the_same_max_tokens(redis_url, embedder):
    tenant = f"t-{uuid.uuid4().hex}"

    async def body(cache):
        first = await cache.lookup(_request(tenant, mode="semantic", temperature=0.7), "m")
        await cache.store(first.fill, _completion(finish_reason="length", tokens=4))
        same = await cache.lookup(_request(tenant, mode="semantic", temperature=0.7), "m")
        more_room = await cache.lookup(_request(tenant, mode="semantic", temperature=0.7, max_tokens=64), "m")
        await cache.semantic.clear(tenant, "m|chat")
        return same.result, more_room.result

    assert _run(redis_url, body, embedder) == ("semantic", "miss")



def test_a_semantic_entry_answers_only_requests_with_the_same_cache_salt(redis_url, embedder):
    tenant = f"t-{uuid.uuid4().hex}"

    def salted(salt: str | None) -> p.GenerateRequest:
        request = _request(tenant, mode="semantic", temperature=0.7)
        request.cache_salt = salt
        return request

    async def body(cache):
        await cache.store((await cache.lookup(salted("a"), "m")).fill, _completion())
        results = [(await cache.lookup(salted(salt), "m")).result for salt in ("a", "b", None)]
        for scope in ("m|chat|a", "m|chat|b", "m|chat"):
            await cache.semantic.clear(tenant, scope)
        return results

    assert _run(redis_url, body, embedder) == ["semantic", "miss", "miss"]
