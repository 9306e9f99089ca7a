"""The GPU worker: a consumer-group member on its model's work stream and on its own inbox (where the
router sends what this worker's prefix cache suits) that feeds the async engine.

Requests stream in as capacity frees (the engine batches them continuously); each request's token
deltas go, numbered, to its reply stream, and the work entry is acknowledged only after the final chunk.
A heartbeat keeps this worker's pending entries fresh and sends its prefix-cache changes to the prefix
directory; a janitor takes entries whose owner stopped refreshing them (it died), and dead workers'
inboxes, and resumes them from what their reply streams already hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import defaultdict

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from cache.prefix_directory import PrefixDirectory
from cache.response_cache import ResponseCache
from gpu_worker.engine import AsyncLLMEngine, InvalidRequestError, RequestOutput
from gpu_worker.metrics import WorkerMetrics
from gpu_worker.orphan_inboxes import OrphanInboxes
from gpu_worker.request_clock import RequestClock
from gpu_worker.request_codec import ReplyHistory, logprob_entries, prompt_ids, sampling_params
from services.base import protocol as p
from services.base import replies, streams, telemetry
from services.base.asyncio_tasks import cancel_and_wait
from services.base.redis_client import BLOCK_MS, UNREACHABLE, until_reachable
from services.base.settings import StreamSettings, WorkerSettings

log = logging.getLogger(__name__)

PUBSUB_CLOSE_TIMEOUT_S = 2.0
# A cancelled loop or request ends in well under this (a pubsub close is bounded at 2 s): one that has not lost its
# cancellation somewhere, and the drain goes on without it rather than hold the worker past its stop deadline.
TASK_STOP_TIMEOUT_S = 10.0


class Worker:
    def __init__(self, redis: aioredis.Redis, engine: AsyncLLMEngine, info: p.ModelInfo, worker_id: str,
                 settings: WorkerSettings, stream_settings: StreamSettings, caches: ResponseCache,
                 metrics: WorkerMetrics, metrics_port: int | None = None):
        self.redis, self.engine, self.info, self.worker_id = redis, engine, info, worker_id
        self.caches = caches
        self.settings, self.streams = settings, stream_settings
        self.shared = p.work_stream(info.name)  # what the router sends to no worker in particular
        self.inbox = p.inbox_stream(info.name, worker_id)
        self.replies = replies.ReplyPublisher(redis, stream_settings)
        self.directory = PrefixDirectory(redis, info.name)
        self.orphans = OrphanInboxes(redis, info.name, worker_id, stream_settings, self.directory)
        self.metrics, self.metrics_port = metrics, metrics_port
        self.worker_fields = {"tier": info.tier, "worker_class": settings.worker_class or
                              ("cpu" if settings.device == "cpu" else "gpu")}
        self.inflight: dict[str, tuple[streams.Delivery, asyncio.Task]] = {}  # request id -> (its entry, its task)
        self.draining = False
        # Set as the drain stops the background loops, which also end on it (and the read and janitor loops on
        # `draining`) at their next turn: a cancellation can be lost in a library (one lost inside a Redis call,
        # see `services.base.asyncio_tasks`, left a heartbeat loop beating on and held a drain for 15 minutes).
        self.stopping = False
        self._slot_freed = asyncio.Event()
        self._directory_stale = False
        self._beats = 0

    # ---- lifecycle ------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        # What keys the prompt ids requests carry for this engine (`request_codec.prompt_ids`): hashed once, now,
        # rather than on the first request's path.
        await asyncio.to_thread(lambda: self.engine.engine.tokenizer.fingerprint)
        await self._ensure_groups()
        await self.redis.hset(p.MODELS_KEY, self.info.name, self.info.model_dump_json())
        await self.directory.forget(self.worker_id)  # a worker id reused after a restart: its cache is empty
        await self._heartbeat()
        loops = [asyncio.create_task(streams.restarting(loop.__name__, loop, log, self.redis), name=loop.__name__)
                 for loop in (self._read_loop, self._janitor_loop, self._heartbeat_loop, self._cancel_loop)]
        await stop.wait()
        await self.drain(loops)

    async def drain(self, loops: list[asyncio.Task]) -> None:
        """Stop taking work, let in-flight requests finish within the deadline, hand back the rest."""
        self.draining = True
        log.info("worker %s draining: %d requests in flight", self.worker_id, len(self.inflight))
        read, janitor, *_ = loops
        read.cancel()
        janitor.cancel()
        if self.inflight:  # the heartbeat goes on meanwhile, keeping their entries ours
            await asyncio.wait([task for _, task in self.inflight.values()], timeout=self.settings.drain_timeout_s)
        self.stopping = True  # no refresh after this point: it would undo the hand-back
        stage = f"worker {self.worker_id} draining"
        await cancel_and_wait(loops, TASK_STOP_TIMEOUT_S, log, stage)
        leftover = dict(self.inflight)
        await cancel_and_wait((task for _, task in leftover.values()), TASK_STOP_TIMEOUT_S, log, stage)
        log.info("worker %s draining: loops stopped, %d requests to hand back", self.worker_id, len(leftover))
        await self.replies.flushed()  # the next owner resumes from what the reply streams hold
        for stream, entry_ids in _by_stream(d for d, _ in leftover.values()).items():
            await streams.hand_back(self.redis, stream, p.WORKER_GROUP, self.worker_id, entry_ids, self.streams)
        await self.redis.zrem(p.workers_key(self.info.name), self.worker_id)
        await self.redis.delete(p.heartbeat_key(self.info.name, self.worker_id))  # live workers adopt the inbox
        await self.directory.forget(self.worker_id)
        log.info("worker %s draining: handed back, shutting the engine down", self.worker_id)
        await self.engine.shutdown()
        log.info("worker %s drained; %d requests handed back", self.worker_id, len(leftover))

    # ---- taking work ----------------------------------------------------------------------------------

    async def _ensure_groups(self) -> None:
        for stream in (self.shared, self.inbox):
            await streams.ensure_group(self.redis, stream, p.WORKER_GROUP)
        await self.redis.sadd(p.inboxes_key(self.info.name), self.worker_id)

    async def _read_loop(self) -> None:
        # Again on every (re)start of this loop: after a stall past the heartbeat's TTL, others may have
        # adopted and deleted this worker's inbox.
        await self._ensure_groups()
        while not self.draining:
            free = self._free_slots()
            if not free:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            # One stream at a time: XREADGROUP's COUNT applies per stream, so a read of both could take twice
            # the free slots. The shared stream is used only while no worker is live (start-up): not waited on.
            got = await streams.read_new(self.redis, self.shared, p.WORKER_GROUP, self.worker_id, free, None)
            await self._start(got or await streams.read_new(self.redis, self.inbox, p.WORKER_GROUP, self.worker_id,
                                                            free, BLOCK_MS))

    async def _janitor_loop(self) -> None:
        # Stale entries of its own inbox too: one this worker read and lost (a dropped reply, a failed
        # acknowledgement), or one it held before a restart under the same worker id (same host and pid).
        claimers = [streams.StaleClaimer(self.redis, stream, p.WORKER_GROUP, self.worker_id, self.streams)
                    for stream in (self.shared, self.inbox)]
        while True:
            await asyncio.sleep(self.streams.janitor_interval_s)
            if self.draining:
                return
            if free := self._free_slots():
                claimed = []
                for claimer in claimers:
                    claimed += await claimer.claim(free - len(claimed)) if len(claimed) < free else []
                claimed += await self.orphans.take(free - len(claimed)) if len(claimed) < free else []
                await self._start(await streams.dead_letter_exhausted(self.redis, p.WORKER_GROUP, claimed,
                                                                      self.streams))

    def _free_slots(self) -> int:
        return max(0, self.settings.max_num_seqs - len(self.inflight))

    async def _start(self, deliveries: list[streams.Delivery]) -> None:
        for delivery in deliveries:
            request = _parse(delivery)
            if request is None:
                await streams.dead_letter(self.redis, p.WORKER_GROUP, delivery, "the work entry does not decode",
                                          None, self.streams)
                continue
            if held := self.inflight.get(request.request_id):
                held_delivery, _ = held
                if (held_delivery.stream, held_delivery.entry_id) != (delivery.stream, delivery.entry_id):
                    await self.redis.xack(delivery.stream, p.WORKER_GROUP, delivery.entry_id)  # a second copy
                # else its own entry, claimed back after an outage kept the heartbeat from refreshing it
                continue
            task = asyncio.create_task(self._serve(delivery, request))
            self.inflight[request.request_id] = (delivery, task)

    # ---- serving one request --------------------------------------------------------------------------

    async def _serve(self, delivery: streams.Delivery, request: p.GenerateRequest) -> None:
        rid = request.request_id
        try:
            while True:
                self.replies.reset(rid)
                try:
                    return await self._serve_once(delivery, request)
                except UNREACHABLE as exc:  # Redis restarting: its entry stays ours (the heartbeat refreshes it)
                    log.warning("Redis unreachable serving request %s (%s); resuming it once Redis answers", rid, exc)
                    await until_reachable(self.redis, None)
                    delivery = dataclasses.replace(delivery, claimed=True)  # from what its reply stream holds
        finally:
            self.replies.reset(rid)
            self.inflight.pop(rid, None)
            self._slot_freed.set()

    async def _serve_once(self, delivery: streams.Delivery, request: p.GenerateRequest) -> None:
        rid = request.request_id
        try:
            if await self.redis.exists(p.cancel_key(rid)):
                await self._abandon(delivery, request, "cancelled")
                return
            entries = await replies.reply_history(self.redis, rid) if delivery.claimed else []
            history = ReplyHistory.of(entries)
            if history.closed:
                await self.redis.xack(delivery.stream, p.WORKER_GROUP, delivery.entry_id)
                return
            if request.expired():  # nobody waits for it any more: never started
                await self._expire(delivery, request, replies.sent_usage(chunk for _, chunk in entries))
                return
            attributes = {"gen_ai.request.model": self.info.name, "tokenfleet.worker": self.worker_id,
                          "tokenfleet.request_id": rid}
            with telemetry.hop(f"generate {self.info.name}", request.traceparent, attributes=attributes) as span:
                request.traceparent = telemetry.traceparent(span)  # the completion event is this span's child
                await self._generate(delivery, request, history)
        except (asyncio.CancelledError, *UNREACHABLE):
            raise
        except Exception as exc:  # one request's failure is its own: reported, acknowledged, never retried
            log.exception("request %s failed", rid)
            error = p.ErrorBody(message=f"worker error: {exc}", type="server_error", status=500)
            await self.replies.flushed()  # its client gets every token published before the error: billed
            usage = await replies.sent_usage_of(self.redis, rid)
            await self._close(delivery, request, [p.ReplyChunk(kind="error", error=error, worker_id=self.worker_id)],
                              self._abandoned(request, "error", usage))

    async def _generate(self, delivery: streams.Delivery, request: p.GenerateRequest, history: ReplyHistory) -> None:
        rid, engine = request.request_id, self.engine.engine
        try:
            ids = prompt_ids(engine, request)
            params = sampling_params(engine, request, len(ids), self.settings.default_max_tokens)
        except InvalidRequestError as err:  # the client's fault: "rejected", kept out of SLA attainment
            param = "messages" if request.kind == "chat" and err.param == "prompt" else err.param
            error = p.ErrorBody(message=str(err), param=param, code=err.code or "invalid_request", status=400)
            await self._close(delivery, request, [p.ReplyChunk(kind="error", error=error, worker_id=self.worker_id)],
                              self._abandoned(request, "rejected"))
            return
        if history.started is None:
            started = p.ReplyChunk(kind="started", worker_id=self.worker_id, model=self.info.name,
                                   prompt_tokens=len(ids), cache=_cache_result(request),
                                   traceparent=request.traceparent)
            self.replies.publish_nowait(rid, [started])  # ordered before the deltas; no need to wait for it
        clock = RequestClock(request.enqueued_at, history.first_delta_at,
                             request.routing.decided_at if request.routing else None)
        positions = {i: len(c.token_ids) for i, c in history.choices.items()}
        finish_reasons = {i: c.finish_reason for i, c in history.choices.items()}
        resume = history.resume(params.n)
        last = None
        if resume != []:  # [] : every sample had finished before the last worker died
            try:
                async with asyncio.timeout_at(_loop_time(request.deadline)) as limit:
                    last = await self._relay(rid, ids, params, resume, request, positions, finish_reasons, clock)
            except TimeoutError:
                if not limit.expired():
                    raise
                # stopped where it ran (leaving the engine frees its blocks); billed what was sent
                await self._expire(delivery, request, p.Usage(prompt_tokens=len(ids),
                                                              completion_tokens=sum(positions.values())))
                return
        usage = p.Usage(prompt_tokens=len(ids), completion_tokens=sum(positions.values()),
                        cached_tokens=last.num_cached_tokens if last else 0,
                        draft_tokens=last.num_draft_tokens if last else 0,
                        accepted_draft_tokens=last.num_accepted_draft_tokens if last else 0)
        timing = clock.timing(usage.completion_tokens, last.engine_seconds if last else 0.0)
        clock.trace(request, usage)
        finished = p.ReplyChunk(kind="finished", worker_id=self.worker_id, model=self.info.name, usage=usage,
                                timing=timing, cache=_cache_result(request))
        event = p.CompletionEvent(request_id=rid, model=self.info.name, worker_id=self.worker_id,
                                  api_key_name=request.api_key_name, api_key_id=request.api_key_id,
                                  user=request.user,
                                  finish_reasons=[finish_reasons.get(i) for i in range(params.n)], usage=usage,
                                  timing=timing, routing=request.routing, deliveries=delivery.deliveries,
                                  sla_class=request.sla_class, enqueued_at=request.enqueued_at,
                                  traceparent=request.traceparent, **self.worker_fields)
        if request.cache_fill is not None:
            await self._fill_cache(request, usage)
        # Observed before the reply closes: a scrape right after the client has its last token counts it.
        self.metrics.observe(timing, usage.completion_tokens)
        await self._close(delivery, request, [finished], event)

    async def _fill_cache(self, request: p.GenerateRequest, usage: p.Usage) -> None:
        """The whole response, as its reply stream holds it (a resumed request's too), into the caches before
        the response ends, so a client repeating it at once finds it (a millisecond on opted-in requests only).
        A cache write that fails costs a later hit, never this request."""
        try:
            history = ReplyHistory.of(await replies.reply_history(self.redis, request.request_id))
            completion = history.completion(self.info.name, usage, request.sampling.max_tokens)
            await self.caches.store(request.cache_fill, completion)
        except Exception:
            log.exception("storing request %s in the response cache failed", request.request_id)

    async def _relay(self, rid: str, ids: list[int], params, resume, request: p.GenerateRequest,
                     positions: dict[int, int], finish_reasons: dict[int, str | None],
                     clock: RequestClock) -> RequestOutput | None:
        """Engine deltas to the reply stream, numbered by position per sample; returns the last output."""
        engine, out = self.engine.engine, None
        # aclosing: a cancel that lands while a chunk is being published must still abort the request.
        async with contextlib.aclosing(self.engine.generate(rid, ids, params, priority=request.priority,
                                                            resume=resume, cache_salt=request.cache_salt)) as outputs:
            async for out in outputs:
                clock.token()
                chunks = []
                for delta in out.outputs:
                    position = positions.get(delta.index, 0)
                    positions[delta.index] = position + len(delta.token_ids)
                    finish_reasons[delta.index] = delta.finish_reason
                    chunks.append(p.ReplyChunk(kind="delta", worker_id=self.worker_id, index=delta.index,
                                               position=position,
                                               token_ids=delta.token_ids, text=delta.text,
                                               finish_reason=delta.finish_reason,
                                               logprobs=logprob_entries(engine, delta, params.logprobs or 0)))
                await self.replies.publish(rid, chunks)
        return out

    async def _close(self, delivery: streams.Delivery, request: p.GenerateRequest, chunks: list[p.ReplyChunk],
                     event: p.CompletionEvent) -> None:
        """The final chunks, the completion event and the acknowledgement, all or none, unless the request was
        cancelled first (its client told it ended unfinished): then it ends as cancelled."""
        rid = request.request_id
        additions = streams.final_replies(rid, chunks, event, self.streams)
        outcome = await self.replies.finish(rid, lambda: streams.ack_then_add(
            self.redis, delivery.stream, p.WORKER_GROUP, delivery.entry_id, additions, veto=p.cancel_key(rid)))
        if outcome is streams.Outcome.VETOED:
            await self._abandon(delivery, request, "cancelled")
        self.inflight.pop(rid, None)  # acknowledged: no longer ours to refresh (a cache fill may follow)

    async def _expire(self, delivery: streams.Delivery, request: p.GenerateRequest, usage: p.Usage) -> None:
        """Its deadline passed: its client told so, its row says `expired`, billed `usage` (what was sent)."""
        error = p.ReplyChunk(kind="error", error=p.deadline_exceeded(), worker_id=self.worker_id)
        await self._close(delivery, request, [error], self._abandoned(request, "expired", usage))

    # ---- liveness and cancellation --------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            await self._heartbeat()

    async def _heartbeat(self) -> None:
        stats = self.engine.engine.stats()
        status = p.WorkerStatus(worker_id=self.worker_id, model=self.info.name,
                                running=int(stats["num_requests_running"]), waiting=int(stats["num_requests_waiting"]),
                                inflight=len(self.inflight),
                                backlog=await streams.unread(self.redis, self.inbox, p.WORKER_GROUP),
                                kv_blocks_used=int(stats["kv_blocks_used"]),
                                kv_blocks_total=int(stats["kv_blocks_total"]), draining=self.draining,
                                metrics_port=self.metrics_port, updated_at=time.time())
        ttl, now = self.settings.heartbeat_ttl_s, time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(p.heartbeat_key(self.info.name, self.worker_id), status.model_dump_json(), px=int(ttl * 1000),
                     get=True)
            pipe.zremrangebyscore(p.workers_key(self.info.name), "-inf", now)  # workers that died
            if not self.draining:
                pipe.zadd(p.workers_key(self.info.name), {self.worker_id: now + ttl})
                pipe.sadd(p.inboxes_key(self.info.name), self.worker_id)
            previous, *_ = await pipe.execute()
        if previous is None and self._beats:  # it lapsed (a stall): others may have adopted the inbox and
            self._directory_stale = True  # dropped this worker from the prefix directory
            await self._ensure_groups()
        self._beats += 1
        await self._publish_prefix_changes()
        lost = set()
        for stream, entry_ids in _by_stream(d for d, _ in self.inflight.values()).items():
            try:
                lost.update((stream, e) for e in await streams.refresh(self.redis, stream, p.WORKER_GROUP,
                                                                      self.worker_id, entry_ids))
            except ResponseError:  # NOGROUP: the inbox was adopted and deleted; its entries went with it
                lost.update((stream, e) for e in entry_ids)
        for request_id, (delivery, task) in list(self.inflight.items()):
            if (delivery.stream, delivery.entry_id) in lost:  # taken over while this worker stalled
                log.warning("request %s was taken over by another worker; dropping it here", request_id)
                task.cancel()

    async def _publish_prefix_changes(self) -> None:
        changes = self.engine.engine.drain_kv_events(resend_all=self._directory_stale)
        self._directory_stale = True  # until the write succeeds: a lost batch of events is resent in full
        await self.directory.apply(self.worker_id, *changes)
        self._directory_stale = False
        self._beats = 0

    async def _cancel_loop(self) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(p.CANCEL_CHANNEL)
            while not self.stopping:
                # Polled with a timeout: a blocking listen would hit the client's socket timeout when idle.
                message = await pubsub.get_message(timeout=BLOCK_MS / 1000)
                if message and (entry := self.inflight.get(message["data"])):
                    delivery, task = entry
                    task.cancel()  # generate()'s exit aborts the request and frees its blocks
                    if request := _parse(delivery):
                        with contextlib.suppress(Exception):
                            await self._abandon(delivery, request, "cancelled")
        finally:
            # Not `async with`: PubSub.aclose() can wait forever for its socket to close (redis-py #3941), which
            # held a draining worker past its stop deadline; a bounded close lets the drain go on.
            with contextlib.suppress(Exception):  # asyncio.TimeoutError is one
                await asyncio.wait_for(pubsub.aclose(), PUBSUB_CLOSE_TIMEOUT_S)

    def _abandoned(self, request: p.GenerateRequest, status: p.TaskStatus,
                   usage: p.Usage | None = None) -> p.CompletionEvent:
        return p.CompletionEvent.abandoned(request, status, self.worker_id, usage, **self.worker_fields)

    async def _abandon(self, delivery: streams.Delivery, request: p.GenerateRequest, status: p.TaskStatus) -> None:
        """Acknowledge a request that will not finish, with its completion event: what its reply stream shows
        it got (a cancelled stream's tokens were computed and sent; the ledger counts them). Once: a request that
        finished as the cancel came, or that the other path (the task's own, the cancel loop's) abandoned
        already, keeps the event it has."""
        usage = await replies.sent_usage_of(self.redis, request.request_id)
        if status == "cancelled" and request.expired():  # its gateway stopped waiting at the deadline
            status = "expired"
        await streams.ack_then_add(self.redis, delivery.stream, p.WORKER_GROUP, delivery.entry_id,
                                   [streams.Addition(p.EVENTS_STREAM, self._abandoned(request, status, usage))])


def _loop_time(deadline: float | None) -> float | None:
    """An epoch deadline on the event loop's clock (None: none)."""
    return None if deadline is None else asyncio.get_running_loop().time() + (deadline - time.time())


def _cache_result(request: p.GenerateRequest) -> str | None:
    return request.routing.cache if request.routing else None


def _by_stream(deliveries) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = defaultdict(list)
    for delivery in deliveries:
        grouped[delivery.stream].append(delivery.entry_id)
    return grouped


def _parse(delivery: streams.Delivery) -> p.GenerateRequest | None:
    try:
        return p.decode(p.GenerateRequest, delivery.fields)
    except ValueError:
        log.error("work entry %s does not decode", delivery.entry_id)
        return None
