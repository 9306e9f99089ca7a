"""The response caches as the router and the workers use them: the exact cache (a Redis key per request,
for deterministic requests) and the semantic cache (`semantic_cache.py`), scoped per tenant (the API key).

Exact: the key hashes the model, the whole conversation (or prompt) and every sampling field, so a request
that differs in anything that could change its output misses. Only deterministic requests use it
(temperature 0, or a fixed seed), and not requests for logprobs (not kept).
Semantic (opt-in): the whole conversation's embedding; never for n > 1; an answer cut off by max_tokens only
stands for a question asked with the same max_tokens (not one given more room).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from cache.embedder import conversation_text
from cache.semantic_cache import SemanticCache, decode_vector, encode_vector
from services.base import protocol as p
from services.base.settings import CacheSettings

ANONYMOUS = "anonymous"


def exact_key(tenant: str, model: str, request: p.GenerateRequest) -> str:
    identity = {"model": model, "kind": request.kind, "messages": request.messages, "prompt": request.prompt,
                "sampling": request.sampling.model_dump(), "cache_salt": request.cache_salt}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return f"{p.PREFIX}:exact-cache:{tenant}:{digest}"


def semantic_scope(model: str, request: p.GenerateRequest) -> str:
    """What a semantic entry may answer besides its tenant: the model, chat or completion, the cache salt."""
    return "|".join([model, request.kind, *([request.cache_salt] if request.cache_salt else [])])


def deterministic(sampling: p.SamplingOptions) -> bool:
    return (sampling.temperature == 0 or sampling.seed is not None) and sampling.logprobs is None


@dataclass(frozen=True)
class CacheLookup:
    result: str | None  # None: not asked; "miss", "exact", "semantic"
    completion: p.CachedCompletion | None = None
    similarity: float | None = None
    fill: p.CacheFill | None = None  # on a miss: what the worker stores when it finishes


NOT_ASKED = CacheLookup(None)


class ResponseCache:
    def __init__(self, redis: aioredis.Redis, settings: CacheSettings, semantic: SemanticCache | None = None):
        self.redis, self.settings = redis, settings
        self.semantic = semantic or SemanticCache(redis, settings)  # its embedder loads on first use

    async def lookup(self, request: p.GenerateRequest, model: str) -> CacheLookup:
        if request.cache_mode == "off":
            return NOT_ASKED
        tenant = request.api_key_name or ANONYMOUS
        fill = p.CacheFill(tenant=tenant)
        if deterministic(request.sampling):
            fill.exact_key = exact_key(tenant, model, request)
            if raw := await self.redis.get(fill.exact_key):
                return CacheLookup("exact", p.CachedCompletion.model_validate_json(raw))
        if request.cache_mode == "semantic" and request.sampling.n == 1 and request.sampling.logprobs is None:
            text = conversation_text(request.messages, request.prompt)
            vector, scope = await self.semantic.vector(text), semantic_scope(model, request)
            hit = await self.semantic.lookup(tenant, scope, text, vector)
            if hit and _fits(hit.completion, request.sampling.max_tokens):
                return CacheLookup("semantic", hit.completion, hit.similarity)
            fill.semantic_scope, fill.semantic_text, fill.semantic_vector = scope, text, encode_vector(vector)
        if fill.exact_key is None and fill.semantic_text is None:
            return CacheLookup("miss")  # asked, but nothing about this request can be cached
        return CacheLookup("miss", fill=fill)

    async def store(self, fill: p.CacheFill, completion: p.CachedCompletion) -> None:
        if fill.exact_key:
            await self.redis.set(fill.exact_key, completion.model_dump_json(), ex=self.settings.exact_ttl_s)
        if fill.semantic_text is not None:
            await self.semantic.store(fill.tenant, fill.semantic_scope, fill.semantic_text,
                                      decode_vector(fill.semantic_vector), completion)


def _fits(completion: p.CachedCompletion, max_tokens: int | None) -> bool:
    for choice in completion.choices:
        if choice.finish_reason == "length" and max_tokens != completion.max_tokens:
            return False
        if max_tokens is not None and len(choice.token_ids) > max_tokens:
            return False
    return True
