"""Delivery rules on a real Redis: dead-lettering after K deliveries, graceful drain, hashed keys."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from dataclasses import dataclass

import httpx

from services.accounting import ledger
from services.base import protocol as p
from services.base import replies, streams
from services.base.redis_client import connect
from services.base.settings import StreamSettings
from services.tenancy.auth import authenticate, register_key
from tests.stack import API_KEY, MODEL


def test_a_request_delivered_more_than_k_times_is_dead_lettered_and_its_client_gets_an_error(redis_url):
    settings = StreamSettings(max_deliveries=2, claim_idle_ms=0)
    stream, request = f"test-work-{uuid.uuid4().hex}", p.GenerateRequest(
        request_id=uuid.uuid4().hex, kind="completion", model="m", prompt="hi", sampling=p.SamplingOptions())

    async def scenario():
        redis = connect(redis_url)
        await streams.ensure_group(redis, stream, p.WORKER_GROUP)
        await redis.xadd(stream, request.encode())
        served = await streams.read_new(redis, stream, p.WORKER_GROUP, "worker-a", 1, 100)
        for owner in ("worker-b", "worker-c"):  # each takes it from a "dead" owner
            claimed = await streams.StaleClaimer(redis, stream, p.WORKER_GROUP, owner, settings).claim(10)
            served = await streams.dead_letter_exhausted(redis, p.WORKER_GROUP, claimed, settings)
        letters = [p.decode(p.DeadLetter, f) for _, f in await redis.xrange(p.DEAD_LETTER_STREAM)]
        chunks = [c async for c in replies.follow_replies(redis, request.request_id, 5)]
        pending = (await redis.xpending(stream, p.WORKER_GROUP))["pending"]
        await redis.delete(stream)
        await redis.aclose()
        return served, letters, chunks, pending

    served, letters, chunks, pending = asyncio.run(scenario())
    assert served == [] and pending == 0
    letter = next(x for x in letters if x.request_id == request.request_id)
    assert letter.deliveries == 3 and letter.request == request
    assert chunks[-1].kind == "error" and chunks[-1].error.code == "dead_letter"


def test_a_dead_lettered_request_is_billed_the_tokens_its_client_was_sent(redis_url):
    """Its workers kept dying mid-stream: the client got the tokens before the error, and its row bills those (a
    resumed worker's repeat of a delta counts once)."""
    settings = StreamSettings(max_deliveries=1, claim_idle_ms=0)
    stream, request = f"test-work-{uuid.uuid4().hex}", p.GenerateRequest(
        request_id=uuid.uuid4().hex, kind="completion", model="m", prompt="hi", sampling=p.SamplingOptions())
    sent = [p.ReplyChunk(kind="started", prompt_tokens=3),
            p.ReplyChunk(kind="delta", position=0, token_ids=[5, 6]),
            p.ReplyChunk(kind="delta", position=2, token_ids=[7]),
            p.ReplyChunk(kind="delta", position=2, token_ids=[7, 8])]  # resumed from position 2 by another worker

    async def scenario():
        redis = connect(redis_url)
        await streams.ensure_group(redis, stream, p.WORKER_GROUP)
        await redis.xadd(stream, request.encode())
        await replies.ReplyPublisher(redis, settings).publish(request.request_id, sent)
        await streams.read_new(redis, stream, p.WORKER_GROUP, "worker-a", 1, 100)
        claimed = await streams.StaleClaimer(redis, stream, p.WORKER_GROUP, "worker-b", settings).claim(10)
        await streams.dead_letter_exhausted(redis, p.WORKER_GROUP, claimed, settings)
        events = p.completion_events(await redis.xrange(p.EVENTS_STREAM))
        await redis.delete(stream)
        await redis.aclose()
        return next(e for e in events if e.request_id == request.request_id)

    event = asyncio.run(scenario())
    assert event.status == "dead-lettered"
    assert (event.usage.prompt_tokens, event.usage.completion_tokens) == (3, 4)


def test_a_request_entry_that_does_not_decode_is_dead_lettered_and_its_client_told_at_once(stack):
    request_id = uuid.uuid4().hex
    entry = json.loads(p.GenerateRequest(request_id=request_id, kind="completion", model=MODEL, prompt="hi",
                                         sampling=p.SamplingOptions()).encode()[p.FIELD])
    entry["sampling"]["repetition_penalty"] = None  # what a non-finite number serialized to

    async def scenario():
        redis = connect(stack.redis_url)
        try:
            await redis.xadd(p.REQUESTS_STREAM, {p.FIELD: json.dumps(entry)})
            return [c async for c in replies.follow_replies(redis, request_id, 10)]
        finally:
            await redis.aclose()

    chunks = asyncio.run(scenario())
    assert chunks[-1].kind == "error" and chunks[-1].error.code == "dead_letter"
    letters = [p.decode(p.DeadLetter, f) for _, f in stack.redis().xrange(p.DEAD_LETTER_STREAM)]
    assert any(letter.request_id == request_id and letter.request is None for letter in letters)


def _request_entry() -> tuple[str, p.GenerateRequest]:
    request = p.GenerateRequest(request_id=uuid.uuid4().hex, kind="completion", model="m", prompt="hi",
                                sampling=p.SamplingOptions())
    return f"test-stream-{uuid.uuid4().hex}", request


def test_a_stalled_worker_does_not_take_back_what_a_janitor_gave_to_another(redis_url):
    stream, request = _request_entry()
    settings = StreamSettings(claim_idle_ms=0)

    async def scenario():
        redis = connect(redis_url)
        await streams.ensure_group(redis, stream, p.WORKER_GROUP)
        await redis.xadd(stream, request.encode())
        [delivery] = await streams.read_new(redis, stream, p.WORKER_GROUP, "stalled", 1, 100)
        await streams.StaleClaimer(redis, stream, p.WORKER_GROUP, "rescuer", settings).claim(1)
        lost = await streams.refresh(redis, stream, p.WORKER_GROUP, "stalled", [delivery.entry_id])
        kept = await streams.refresh(redis, stream, p.WORKER_GROUP, "rescuer", [delivery.entry_id])
        owner = (await redis.xpending_range(stream, p.WORKER_GROUP, min="-", max="+", count=1))[0]["consumer"]
        await redis.delete(stream)
        await redis.aclose()
        return delivery.entry_id, lost, kept, owner

    entry_id, lost, kept, owner = asyncio.run(scenario())
    assert lost == [entry_id] and kept == [] and owner == "rescuer"


def test_a_request_is_forwarded_once_even_if_two_routers_hold_it(redis_url):
    source, request = _request_entry()
    target = source + "-target"

    async def scenario():
        redis = connect(redis_url)
        await streams.ensure_group(redis, source, p.ROUTER_GROUP)
        entry_id = await redis.xadd(source, request.encode())
        await streams.read_new(redis, source, p.ROUTER_GROUP, "router-a", 1, 100)
        results = [await streams.forward(redis, source, p.ROUTER_GROUP, entry_id, target, request, StreamSettings())
                   for _ in range(2)]
        length = await redis.xlen(target)
        await redis.delete(source, target)
        await redis.aclose()
        return results, length

    results, length = asyncio.run(scenario())
    assert results == [True, False] and length == 1


def test_sigterm_lets_the_worker_finish_its_requests_before_it_exits(stack):
    body = {"model": MODEL, "prompt": "Drain", "max_tokens": 300, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = response.iter_lines()
        next(lines)
        started = p.decode(p.ReplyChunk, stack.redis().xrange(p.reply_stream(response.headers["x-request-id"]))[0][1])
        worker = next(w for w in stack.workers if started.worker_id.endswith(f"-{w.pid}"))
        worker.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert '"completion_tokens":300' in rest[-2]
    assert worker.wait(30) == 0
    stack.wait_for_worker(stack.start_worker(), timeout_s=120)


def test_api_keys_are_stored_only_as_hashes(redis_url):
    async def scenario():
        redis = connect(redis_url)
        key = await register_key(redis, "alice")
        stored = await redis.hgetall(p.API_KEYS_KEY)
        found = await authenticate(redis, f"Bearer {key}")
        wrong = await authenticate(redis, f"Bearer {key}x")
        await redis.aclose()
        return key, stored, found, wrong

    key, stored, found, wrong = asyncio.run(scenario())
    assert all(key not in k and key not in v for k, v in stored.items())
    assert found.name == "alice" and wrong is None


def test_work_a_draining_worker_cannot_finish_in_time_is_handed_back_and_completed_elsewhere(stack):
    # Two workers of a model of their own, up before the request: whichever takes it is told to stop and may
    # drain for only half a second, far less than the request needs.
    model, max_tokens = "handback", 400
    flags = ("--model", "tokenfleet-large", "--served-model-name", model, "--dtype", "bfloat16")
    pair = [stack.start_worker(*flags, env={"TOKENFLEET_WORKER_DRAIN_TIMEOUT_S": "0.5"}) for _ in range(2)]
    for worker in pair:
        stack.wait_for_worker(worker, model)
    body = {"model": model, "prompt": "Hand me back", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = response.iter_lines()
        received = [next(lines)]
        started = p.decode(p.ReplyChunk, stack.redis().xrange(p.reply_stream(response.headers["x-request-id"]))[0][1])
        leaving, staying = sorted(pair, key=lambda w: not started.worker_id.endswith(f"-{w.pid}"))
        leaving.send_signal(signal.SIGTERM)
        received += list(lines)
    assert stack.wait_stopped(leaving) == 0
    chunks = [json.loads(line[6:]) for line in received if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    replies = [p.decode(p.ReplyChunk, f) for _, f in stack.redis().xrange(p.reply_stream(
        response.headers["x-request-id"]))]
    served_by = {c.worker_id for c in replies if c.kind == "delta"}
    assert served_by == {r.worker_id for r in replies if r.kind in ("started", "finished")}
    assert len(served_by) == 2 and replies[-1].worker_id.endswith(f"-{staying.pid}")
    positions = [c.position for c in replies if c.kind == "delta"]
    assert positions == sorted(positions) and sum(len(c.token_ids) for c in replies if c.kind == "delta") == max_tokens
    event = next(e for e in p.completion_events(stack.redis().xrange(p.EVENTS_STREAM))
                 if e.request_id == response.headers["x-request-id"])
    assert event.deliveries == 1  # a hand-back is not counted against the request


@dataclass
class _Finishing:
    """A request a worker took from its stream and is about to finish (its final chunk and event ready)."""

    redis: object
    stream: str
    request: p.GenerateRequest
    worker: object
    delivery: streams.Delivery

    @classmethod
    async def start(cls, redis_url: str) -> _Finishing:
        from gpu_worker.service import Worker
        from services.base.settings import WorkerSettings

        redis, stream = connect(redis_url), f"test-work-{uuid.uuid4().hex}"
        request = p.GenerateRequest(request_id=uuid.uuid4().hex, kind="completion", model=MODEL, prompt="hi",
                                    sampling=p.SamplingOptions())
        info = p.ModelInfo(name=MODEL, model_dir="/m", max_model_len=64)
        worker = Worker(redis, None, info, "w-test", WorkerSettings(), StreamSettings(), None, None)
        await streams.ensure_group(redis, stream, p.WORKER_GROUP)
        await redis.xadd(stream, request.encode())
        [delivery] = await streams.read_new(redis, stream, p.WORKER_GROUP, "w-test", 1, 100)
        return cls(redis, stream, request, worker, delivery)

    def finish(self) -> asyncio.Task:
        usage = p.Usage(prompt_tokens=1, completion_tokens=1)
        finished = p.ReplyChunk(kind="finished", worker_id="w-test", model=MODEL, usage=usage)
        event = p.CompletionEvent(request_id=self.request.request_id, model=MODEL, worker_id="w-test",
                                  finish_reasons=["stop"], usage=usage, timing=p.Timing.unserved(time.time()))
        return asyncio.create_task(self.worker._close(self.delivery, self.request, [finished], event))

    async def events(self) -> list[p.CompletionEvent | p.DeliveryCut]:
        entries = [p.decode_event(f) for _, f in await self.redis.xrange(p.EVENTS_STREAM, "-", "+")]
        return [e for e in entries if e.request_id == self.request.request_id]

    async def close(self) -> int:
        """Returns how many of its work entries are still pending."""
        pending = (await self.redis.xpending(self.stream, p.WORKER_GROUP))["pending"]
        await self.redis.delete(self.stream)
        await self.redis.aclose()
        return pending


def test_a_cancel_at_any_moment_of_a_finish_leaves_exactly_one_completion_event(redis_url):
    """The cancel loop cancels the request's task wherever it is, then abandons the request; a task cut
    between its final chunk and its event once left a finished reply with no event (no ledger row)."""
    async def one(cancel_after: int) -> tuple[int, int]:
        request = await _Finishing.start(redis_url)
        task = request.finish()
        for _ in range(cancel_after):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await request.worker._abandon(request.delivery, request.request, "cancelled")
        events = [e for e in await request.events() if isinstance(e, p.CompletionEvent)]
        return len(events), await request.close()

    async def scenario():
        return [await one(n) for n in range(12)]

    assert asyncio.run(scenario()) == [(1, 0)] * 12


def _ledger_status(events: list[p.CompletionEvent | p.DeliveryCut]) -> str:
    """What the accounting service makes of a request's events: its completion event as its client got it, by the
    count of the gateway's cut, if one came (`ledger.as_delivered`)."""
    [event] = [e for e in events if isinstance(e, p.CompletionEvent)]
    delivered = [e.delivered_tokens for e in events if isinstance(e, p.DeliveryCut)]
    return ledger.as_delivered(event, min(delivered, default=None)).status


def _cancel(request: _Finishing) -> asyncio.Future:
    """The gateway's cancel, its client having got no token."""
    from gateway.delivery_journal import UnjournaledDeliveries
    from gateway.relay import Relay
    from services.base.settings import GatewaySettings

    relay = Relay(request.redis, None, None, GatewaySettings(), StreamSettings(), UnjournaledDeliveries())
    return asyncio.ensure_future(relay.cancel(request.request.request_id, 0))


def test_a_finish_after_the_gateways_cancel_writes_no_reply_and_ends_the_request_cancelled(redis_url):
    async def scenario():
        request = await _Finishing.start(redis_url)
        await _cancel(request)
        await request.finish()
        replies_ = [c.kind for _, c in await replies.reply_history(request.redis, request.request.request_id)]
        return replies_, await request.events(), await request.close()

    replies_, events, pending = asyncio.run(scenario())
    assert replies_ == ["error"] and pending == 0  # the gateway's error chunk, and no "finished" after it
    assert [(type(e).__name__, getattr(e, "status", None)) for e in events] == [
        ("DeliveryCut", None), ("CompletionEvent", "cancelled")]


def test_a_delta_the_worker_publishes_after_the_gateways_cancel_is_not_written(redis_url):
    """The worker is mid-step when the client leaves: that step's delta must not follow the gateway's error chunk
    (nor count as sent to the client)."""
    async def scenario():
        request = await _Finishing.start(redis_url)
        rid = request.request.request_id
        await request.worker.replies.publish(rid, [p.ReplyChunk(kind="delta", text="a", token_ids=[1])])
        await _cancel(request)
        await request.worker.replies.publish(rid, [p.ReplyChunk(kind="delta", text="b", token_ids=[2])])
        replies_ = [c.kind for _, c in await replies.reply_history(request.redis, rid)]
        await request.worker._abandon(request.delivery, request.request, "cancelled")
        return replies_, await request.close()

    replies_, pending = asyncio.run(scenario())
    assert replies_ == ["delta", "error"] and pending == 0


def test_a_cancel_after_the_finish_cuts_the_delivery(redis_url):
    async def scenario():
        request = await _Finishing.start(redis_url)
        await request.finish()
        await _cancel(request)
        return await request.events(), await request.close()

    events, pending = asyncio.run(scenario())
    assert [type(e).__name__ for e in events] == ["CompletionEvent", "DeliveryCut"] and events[0].status == "ok"
    assert _ledger_status(events) == "cancelled" and pending == 0


def test_a_cancel_racing_a_finish_leaves_one_event_and_the_ledger_saying_cancelled(redis_url):
    """The gateway cancels a request its client no longer follows (it left, or a Redis outage outlasted the
    gateway's wait) just as the worker finishes it, at every interleaving of the two."""
    async def one(cancel_after: int) -> tuple[str, int, int]:
        request = await _Finishing.start(redis_url)
        finish = request.finish()
        for _ in range(cancel_after):
            await asyncio.sleep(0)
        await asyncio.gather(finish, _cancel(request))
        events = await request.events()
        return _ledger_status(events), sum(isinstance(e, p.CompletionEvent) for e in events), await request.close()

    async def scenario():
        return [await one(n) for n in range(12)]

    assert asyncio.run(scenario()) == [("cancelled", 1, 0)] * 12


def test_the_events_stream_loses_only_what_accounting_acknowledged(redis_url):
    """Trimmed by the group's acknowledgements, not by length: events pile up while accounting is down."""
    stream = f"test-events-{uuid.uuid4().hex}"

    async def scenario():
        redis = connect(redis_url)
        try:
            await redis.xgroup_create(stream, "accounting", id="0", mkstream=True)
            ids = [await redis.xadd(stream, {"n": i}, id=f"{1000 + i}-0") for i in range(10)]  # old: past keep_s
            read = await redis.xreadgroup("accounting", "c", {stream: ">"}, count=6)
            await redis.xack(stream, "accounting", *ids[:4])
            trimmed = [await streams.trim_acknowledged(redis, stream, "accounting", keep_s=600)]
            await redis.xack(stream, "accounting", *ids[4:6])
            trimmed.append(await streams.trim_acknowledged(redis, stream, "accounting", keep_s=600))
            recent = await redis.xadd(stream, {"n": "now"})  # acknowledged, but within keep_s
            await redis.xreadgroup("accounting", "c", {stream: ">"})
            await redis.xack(stream, "accounting", *ids[6:], recent)
            trimmed.append(await streams.trim_acknowledged(redis, stream, "accounting", keep_s=600))
            return len(read[0][1]), trimmed, [e for e, _ in await redis.xrange(stream)]
        finally:
            await redis.delete(stream)
            await redis.aclose()

    read, trimmed, left = asyncio.run(scenario())
    assert read == 6 and trimmed == [4, 2, 4] and len(left) == 1


def test_completion_events_are_not_trimmed_by_length(redis_url):
    settings = StreamSettings(stream_maxlen=5)

    async def scenario():
        redis = connect(redis_url)
        try:
            since = f"{int(time.time() * 1000) - 1}-0"
            request = p.GenerateRequest(request_id=uuid.uuid4().hex, kind="completion", model="m", prompt="hi",
                                        sampling=p.SamplingOptions())
            for _ in range(300):  # dead-lettered requests: one abandoned event each (a macro node is 100)
                stream = f"test-work-{uuid.uuid4().hex}"
                await redis.xadd(stream, request.encode())
                delivery = streams.Delivery(stream, "0-1", request.encode(), 4)
                await streams.dead_letter(redis, p.WORKER_GROUP, delivery, "test", request, settings)
                await redis.delete(stream)
            return sum(e.request_id == request.request_id
                       for e in p.completion_events(await redis.xrange(p.EVENTS_STREAM, min=since)))
        finally:
            await redis.aclose()

    assert asyncio.run(scenario()) == 300


def test_after_a_failed_reply_write_a_request_publishes_nothing_until_it_resumes(redis_url):
    """A write lost to a Redis outage followed by one that lands would leave a gap a client cannot see:
    the next token would pass for the lost one. The request must resume from its stream instead."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def scenario() -> tuple[bool, list[int]]:
        live, rid = connect(redis_url), uuid.uuid4().hex
        publisher = replies.ReplyPublisher(connect("redis://127.0.0.1:1/0"), StreamSettings())  # nothing listens

        def delta(position: int) -> p.ReplyChunk:
            return p.ReplyChunk(kind="delta", index=0, position=position, token_ids=[position])

        lost = publisher.publish_nowait(rid, [delta(0)])  # not awaited by the request, as a "started" chunk is
        await asyncio.gather(lost, return_exceptions=True)
        publisher.redis = live  # Redis is back
        try:
            await publisher.publish(rid, [delta(1)])
            refused = False
        except RedisConnectionError:
            refused = True
        publisher.reset(rid)  # resumed from what the stream holds: nothing, so from position 0
        await publisher.publish(rid, [delta(0)])
        positions = [chunk.position for _, chunk in await replies.reply_history(live, rid)]
        await live.delete(p.reply_stream(rid))
        await live.aclose()
        return refused, positions

    assert asyncio.run(scenario()) == (True, [0])
