"""Real Redis (REDIS_URL, else an embedded server) and the real MiniLM embedder for the cache tests."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cache.embedder import Embedder
from cache.guard import conflict
from cache.semantic_cache import KEY_PREFIX, SemanticCache
from services.base.protocol import CachedChoice, CachedCompletion, Usage
from services.base.redis_client import connect
from services.base.settings import CacheSettings


def completion(text: str) -> CachedCompletion:
    return CachedCompletion(model="m", choices=[CachedChoice(text=text, token_ids=[1, 2], finish_reason="stop")],
                            usage=Usage(prompt_tokens=5, completion_tokens=2))


class Caches:
    """SemanticCache instances over one Redis, as separate processes would hold them; each has its own
    connection. Tenants are unique to the test (`tenant("a")`) and their keys are deleted afterwards."""

    def __init__(self, redis_url: str, embedder: Embedder):
        self.redis_url, self.embedder = redis_url, embedder
        self.run_id = f"test-{uuid.uuid4().hex[:10]}"

    def tenant(self, name: str = "a") -> str:
        return f"{self.run_id}-{name}"

    def vector(self, text: str):
        return self.embedder.embed_one(text)

    def run(self, scenario, **settings):
        """`await scenario(new_cache)`, where `new_cache(guard, **settings overrides)` is another process's
        cache."""
        async def main():
            clients = []

            def new_cache(guard=conflict, **overrides) -> SemanticCache:
                clients.append(connect(self.redis_url))
                return SemanticCache(clients[-1], CacheSettings(**{**settings, **overrides}), self.embedder, guard)

            try:
                return await scenario(new_cache)
            finally:
                redis = connect(self.redis_url)
                keys = [key async for key in redis.scan_iter(f"{KEY_PREFIX}:{self.run_id}-*")]
                if keys:
                    await redis.delete(*keys)
                for client in [redis, *clients]:
                    await client.aclose()

        return asyncio.run(main())


@pytest.fixture
def caches(redis_url, embedder) -> Caches:
    return Caches(redis_url, embedder)
