"""Admission: is the model served, is a worker alive, is its queue short enough. Answers 404/503/429
up front instead of queueing without bound."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from gateway.schemas import RequestError
from services import protocol as p
from services.settings import GatewaySettings, RouterSettings

# The codes of the refusals below: a request refused with one was never enqueued.
REFUSALS = frozenset({"model_not_found", "no_worker", "queue_full"})


def inflight_key(model: str) -> str:
    """Sorted set of the gateway's unfinished requests for a requested model, scored by enqueue time."""
    return f"{p.PREFIX}:inflight:{model}"


async def served_models(redis: aioredis.Redis) -> dict[str, p.ModelInfo]:
    return {name: p.ModelInfo.model_validate_json(raw) for name, raw in (await redis.hgetall(p.MODELS_KEY)).items()}


async def alive_workers(redis: aioredis.Redis, model: str) -> int:
    return await redis.zcount(p.workers_key(model), time.time(), "+inf")


class Admission:
    def __init__(self, redis: aioredis.Redis, settings: GatewaySettings, tiers: RouterSettings):
        self.redis, self.settings = redis, settings
        self.tiers = (tiers.small_model, tiers.large_model)

    async def admit(self, model: str, request_id: str) -> None:
        """Raises `RequestError` (404, 503 or 429 with Retry-After); else counts the request in flight.
        One round trip reads everything the decision needs; a second records the admission."""
        candidates = list(self.tiers) if model == p.AUTO_MODEL else [model]
        key, now = inflight_key(model), time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(p.MODELS_KEY)
            for candidate in candidates:
                pipe.zcount(p.workers_key(candidate), now, "+inf")
            pipe.zremrangebyscore(key, "-inf", now - self.settings.request_timeout_s)  # left by a crashed gateway
            pipe.zcard(key)
            served, *alive, _, depth = await pipe.execute()
        if not any(c in served for c in candidates):
            raise RequestError(p.ErrorBody(message=f"The model '{model}' does not exist", param="model",
                                           code="model_not_found", status=404))
        if not any(n for c, n in zip(candidates, alive, strict=True) if c in served):
            raise self._refusal(503, f"no worker of model '{model}' is alive; retry shortly", "no_worker")
        if depth >= self.settings.max_queue_depth:
            raise self._refusal(429, f"model '{model}' has {depth} requests in flight (limit "
                                     f"{self.settings.max_queue_depth}); retry later", "queue_full")
        await self.redis.zadd(key, {request_id: now})

    async def release(self, model: str, request_id: str) -> None:
        await self.redis.zrem(inflight_key(model), request_id)

    def _refusal(self, status: int, message: str, code: str) -> RequestError:
        kind = "rate_limit_error" if status == 429 else "server_error"
        return RequestError(p.ErrorBody(message=message, type=kind, code=code, status=status),
                            {"Retry-After": str(self.settings.retry_after_s)})
