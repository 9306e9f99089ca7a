"""Admission: is the model served, is a worker alive, is its queue short enough. Answers 404/503/429
up front instead of queueing without bound."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from services.base import protocol as p
from services.base.settings import GatewaySettings, RouterSettings
from services.openai_api.context_window import ContextWindow
from services.openai_api.schemas import RequestError
from services.text.errors import CONTEXT_LENGTH_EXCEEDED

# The codes of the refusals below: a request refused with one was never enqueued.
REFUSALS = frozenset({"model_not_found", "no_worker", "queue_full", "invalid_value", "accounting_backlog",
                      CONTEXT_LENGTH_EXCEEDED})


def inflight_key(model: str) -> str:
    """Sorted set of the gateway's unfinished requests that may run on a served model, scored by enqueue time."""
    return f"{p.PREFIX}:inflight:{model}"


def model_infos(models: dict[str, str]) -> dict[str, p.ModelInfo]:
    """The `MODELS_KEY` hash as read from Redis, parsed."""
    return {name: p.ModelInfo.model_validate_json(raw) for name, raw in models.items()}


async def served_models(redis: aioredis.Redis) -> dict[str, p.ModelInfo]:
    return model_infos(await redis.hgetall(p.MODELS_KEY))


async def alive_workers(redis: aioredis.Redis, model: str) -> int:
    return await redis.zcount(p.workers_key(model), time.time(), "+inf")


async def in_flight(redis: aioredis.Redis, model: str, request_timeout_s: float) -> int:
    """Requests admitted for the model and not yet finished (what a crashed gateway left, once timed out, not
    counted); `auto` requests count against each tier's model, as admission counts them."""
    return await redis.zcount(inflight_key(model), time.time() - request_timeout_s, "+inf")


# Every candidate's in-flight set pruned of what a crashed gateway left, counted, and the request added to them
# all, or to none when one is full: one step, so parallel admissions (and several gateways) cannot overfill a
# queue. Returns 0, or 1 + the index of the full set followed by its depth.
_ADMIT = """
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[2])
  local depth = redis.call('ZCARD', key)
  if depth >= tonumber(ARGV[3]) then return {i, depth} end
end
for _, key in ipairs(KEYS) do redis.call('ZADD', key, ARGV[1], ARGV[4]) end
return {0, 0}
"""


class Admission:
    def __init__(self, redis: aioredis.Redis, settings: GatewaySettings, tiers: RouterSettings,
                 max_events_backlog: int, context: ContextWindow | None = None):
        """`max_events_backlog`: completion events not yet trimmed past which work is refused (503): the
        accounting service is down or behind, and the events stream is never trimmed of unrecorded events."""
        self.redis, self.settings, self.max_events_backlog = redis, settings, max_events_backlog
        self.context = context or ContextWindow()
        self.tiers = (tiers.small_model, tiers.large_model)
        self._admit = redis.register_script(_ADMIT)

    def _candidates(self, model: str) -> list[str]:
        """The served models a request for `model` may run on: model="auto" may land on either tier, so it
        counts against both tiers' queues (one model's queue is one bound, whatever the requests named)."""
        return list(dict.fromkeys(self.tiers)) if model == p.AUTO_MODEL else [model]

    async def admit(self, message: p.GenerateRequest) -> None:
        """Raises `RequestError` (400, 404, 503 or 429 with Retry-After); else counts the request in flight, its
        prompt's ids attached for the router and the worker (`ContextWindow`). One round trip reads the served
        models and live workers; a script admits against the queue depth."""
        model, max_tokens = message.model, message.sampling.max_tokens
        candidates, now = self._candidates(model), time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(p.MODELS_KEY)
            pipe.xlen(p.EVENTS_STREAM)
            for candidate in candidates:
                pipe.zcount(p.workers_key(candidate), now, "+inf")
            models, backlog, *alive = await pipe.execute()
        served = model_infos({name: raw for name, raw in models.items() if name in candidates})
        if not served:
            raise RequestError(p.ErrorBody(message=f"The model '{model}' does not exist", param="model",
                                           code="model_not_found", status=404))
        longest = max(info.max_model_len for info in served.values())
        if max_tokens is not None and max_tokens >= longest:  # at least one prompt token must fit beside it
            raise RequestError(p.ErrorBody(message=f"max_tokens is too large: {max_tokens}. The model '{model}' has "
                                                   f"a context of {longest} tokens, prompt included",
                                           param="max_tokens", code="invalid_value"))
        await self.context.check(message, served)
        if not any(n for c, n in zip(candidates, alive, strict=True) if c in served):
            raise self._refusal(503, f"no worker of model '{model}' is alive; retry shortly", "no_worker")
        if backlog >= self.max_events_backlog:
            raise self._refusal(503, f"{backlog} finished requests are waiting to be accounted for; retry later",
                                "accounting_backlog")
        full, depth = await self._admit(keys=[inflight_key(c) for c in candidates],
                                        args=[now, now - self.settings.request_timeout_s,
                                              self.settings.max_queue_depth, message.request_id])
        if full:
            raise self._refusal(429, f"model '{candidates[full - 1]}' has {depth} requests in flight (limit "
                                     f"{self.settings.max_queue_depth}); retry later", "queue_full")

    async def release(self, model: str, request_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for candidate in self._candidates(model):
                pipe.zrem(inflight_key(candidate), request_id)
            await pipe.execute()

    def _refusal(self, status: int, message: str, code: str) -> RequestError:
        kind = "rate_limit_error" if status == 429 else "server_error"
        return RequestError(p.ErrorBody(message=message, type=kind, code=code, status=status),
                            {"Retry-After": str(self.settings.retry_after_s)})
