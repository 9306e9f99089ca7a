"""The router: a consumer group on the request stream that stamps each request with its model and the
reason, and moves it to that model's work stream in one transaction with its acknowledgement."""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from router.policy import TierRule, route
from router.token_count import prompt_tokens
from services import protocol as p
from services import streams
from services.settings import StreamSettings

log = logging.getLogger(__name__)


class Router:
    def __init__(self, redis: aioredis.Redis, rule: TierRule, router_id: str, stream_settings: StreamSettings):
        self.redis, self.rule, self.router_id, self.streams = redis, rule, router_id, stream_settings

    async def run(self, stop: asyncio.Event) -> None:
        await streams.ensure_group(self.redis, p.REQUESTS_STREAM, p.ROUTER_GROUP)
        janitor = asyncio.create_task(streams.restarting("router janitor", self._janitor_loop, log))
        try:
            while not stop.is_set():
                try:
                    got = await streams.read_new(self.redis, p.REQUESTS_STREAM, p.ROUTER_GROUP, self.router_id, 256,
                                                 500)
                    for delivery in got:
                        await self.forward(delivery)
                except aioredis.RedisError:  # Redis restarting: what was read and not forwarded stays pending
                    log.exception("reading the request stream failed; retrying")
                    await asyncio.sleep(1.0)
        finally:
            janitor.cancel()

    async def _janitor_loop(self) -> None:
        claimer = streams.StaleClaimer(self.redis, p.REQUESTS_STREAM, p.ROUTER_GROUP, self.router_id, self.streams)
        while True:
            await asyncio.sleep(self.streams.janitor_interval_s)
            for delivery in await claimer.claim(256):
                await self.forward(delivery)

    async def forward(self, delivery: streams.Delivery) -> None:
        try:
            request = p.decode(p.GenerateRequest, delivery.fields)
        except ValueError:
            log.error("dropping malformed request entry %s", delivery.entry_id)
            await self.redis.xack(p.REQUESTS_STREAM, p.ROUTER_GROUP, delivery.entry_id)
            return
        model, reason = route(request, self.rule, await self._prompt_tokens(request), await self._alive(request))
        request.routing = p.RoutingDecision(model=model, reason=reason, decided_at=time.time())
        await streams.forward(self.redis, p.REQUESTS_STREAM, p.ROUTER_GROUP, delivery.entry_id, p.work_stream(model),
                              request, self.streams)

    async def _alive(self, request: p.GenerateRequest) -> set[str]:
        if request.model != p.AUTO_MODEL:
            return set()
        now = time.time()
        tiers = (self.rule.small_model, self.rule.large_model)
        return {m for m in tiers if await self.redis.zcount(p.workers_key(m), now, "+inf")}

    async def _prompt_tokens(self, request: p.GenerateRequest) -> int | None:
        if request.model != p.AUTO_MODEL:
            return None
        raw = await self.redis.hget(p.MODELS_KEY, self.rule.small_model)
        model_dir = p.ModelInfo.model_validate_json(raw).model_dir if raw else None
        return await asyncio.to_thread(prompt_tokens, request, model_dir)
