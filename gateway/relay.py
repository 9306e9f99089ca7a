"""Enqueue one admitted request and relay its reply stream to the client, whole or as SSE.

The response starts only after the worker's first message ("started" or "error"), so a request the worker
refuses (prompt past the context) still gets its 400 rather than an error inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.delivery_journal import DeliveryJournal, UnjournaledDeliveries
from gateway.idempotency import FirstRequest, Idempotency
from services.base import protocol as p
from services.base.redis_client import RECONNECTING, UNREACHABLE, Outage
from services.base.replies import DeadlineExceeded, end_for_client, follow_replies
from services.base.settings import GatewaySettings, StreamSettings
from services.openai_api.admission import Admission
from services.openai_api.render import ResponseBuilder
from services.openai_api.schemas import CACHE_HEADER, ChatCompletionRequest, RequestError

log = logging.getLogger(__name__)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else p.dumps(obj)}\n\n"


class Relay:
    def __init__(self, redis: aioredis.Redis, admission: Admission, idempotency: Idempotency,
                 settings: GatewaySettings, stream_settings: StreamSettings,
                 journal: DeliveryJournal | UnjournaledDeliveries):
        self.redis, self.admission, self.idempotency = redis, admission, idempotency
        self.settings, self.streams, self.journal = settings, stream_settings, journal
        self._background: set[asyncio.Task] = set()

    def end_inherited(self, owed: dict[str, int]) -> None:
        """Ends for their clients the requests a dead gateway left open (`DeliveryJournal.take`): request id ->
        tokens its client got."""
        for request_id, delivered in owed.items():
            self._later(self.cancel(request_id, delivered))

    async def run(self, req, message: p.GenerateRequest, idempotency_record: tuple[str, str] | None,
                  is_disconnected: Callable[[], Awaitable[bool]]) -> Response:
        """`idempotency_record`: (key hash, Idempotency-Key) under which to keep the whole response."""
        rid = message.request_id
        try:
            await self.admission.admit(message)
        except RequestError:
            if idempotency_record:
                await self.idempotency.forget(*idempotency_record)
            raise
        delivery = _Delivery(rid, self.journal)
        self.journal.opened(rid)
        try:
            await self.redis.xadd(p.REQUESTS_STREAM, message.encode(), maxlen=self.streams.stream_maxlen,
                                  approximate=True)
            return await _unless_client_leaves(
                self._respond(req, rid, message.created, delivery, store=idempotency_record,
                              deadline=message.deadline), is_disconnected)
        except _ClientGone:  # before the response started: nobody is left to answer
            self._later(self.cancel(rid, 0))
            self._later(self._release(req.model, rid))
            return Response(status_code=499)
        except BaseException:  # an error instead of the response: nobody will read the rest (or, if the
            self._later(self.cancel(rid, 0))  # enqueueing failed, it never runs), and no token reached the client
            self._later(self._release(req.model, rid))
            raise

    async def replay(self, req, first: FirstRequest) -> Response:
        """The first request's response for a repeated Idempotency-Key: stored, or followed from its start."""
        if first.result is not None:
            return JSONResponse(first.result)
        return await self._respond(req, first.request_id, first.created, None, store=None)

    async def _respond(self, req, rid: str, created: int, delivery: _Delivery | None, store,
                       deadline: float | None = None) -> Response:
        """`delivery`: what this client got, for the request's owner (None: a replay, which owns nothing)."""
        replies = follow_replies(self.redis, rid, self.settings.request_timeout_s,
                                 outage_s=self.streams.redis_outage_s, deadline=deadline)
        first = await self._first(replies)
        kind = "chat" if isinstance(req, ChatCompletionRequest) else "completion"
        builder = ResponseBuilder(kind, f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rid}", created, first.model,
                                  req.include_usage, req.wants_logprobs)
        marked = {CACHE_HEADER: first.cache} if first.cache else {}
        if req.stream:
            progress = delivery or _Delivery(rid, UnjournaledDeliveries())
            return _RelayedStream(self._events(builder, replies, req, progress), media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", **marked},
                                  on_close=lambda: self._closed(req.model, delivery))
        body = await self._collect(builder, replies, req.n)
        if delivery is not None:
            self.journal.closed(rid)
            self._later(self._release(req.model, rid))
        if store is not None:
            await self.idempotency.store_result(*store, body)
        return JSONResponse(body, headers=marked)

    async def _first(self, replies: AsyncIterator[p.ReplyChunk]) -> p.ReplyChunk:
        with _timeouts_answered():
            first = await anext(replies)
        if first.kind == "error":
            raise RequestError(first.error)
        return first

    async def _collect(self, builder: ResponseBuilder, replies: AsyncIterator[p.ReplyChunk], n: int) -> dict:
        with _timeouts_answered():
            async for chunk in replies:
                if chunk.kind == "delta":
                    builder.add(chunk)
                elif chunk.kind == "error":
                    raise RequestError(chunk.error)
                elif chunk.kind == "finished":
                    return builder.response(chunk, n)
        raise RequestError(p.ErrorBody(message="the reply stream ended early", type="server_error", status=500))

    async def _events(self, builder: ResponseBuilder, replies: AsyncIterator[p.ReplyChunk], req,
                      progress: _Delivery) -> AsyncIterator[str]:
        """Every stream ends with `[DONE]`: after all its tokens, or after an error event (the worker's, or
        this gateway's when it stopped waiting: then the request is cancelled, and its ledger row says so)."""
        try:
            for obj in builder.role_chunks(req.n):
                yield sse(obj)
            async for chunk in replies:
                if chunk.kind == "delta":
                    for obj in builder.delta_chunks(chunk):
                        yield sse(obj)
                    progress.add(len(chunk.token_ids))  # sent: a client gone raises at the yield instead
                elif chunk.kind == "error":
                    yield sse(chunk.error.openai())
                elif chunk.kind == "finished" and (final := builder.final_chunk(chunk)):
                    yield sse(final)
            progress.done = True
        except DeadlineExceeded:
            yield sse(p.deadline_exceeded().openai())
        except TimeoutError as exc:
            yield sse(p.ErrorBody(message=str(exc), type="server_error", code="timeout").openai())
        except UNREACHABLE as exc:
            yield sse(redis_unavailable(exc).openai())
        yield sse("[DONE]")

    def _closed(self, model: str, delivery: _Delivery | None) -> None:
        """After the response ended, however it ended (the client may have left before the first byte)."""
        if delivery is None:  # a replay: the request's owner ends it
            return
        if delivery.done:
            self.journal.closed(delivery.request_id)
        else:
            self._later(self.cancel(delivery.request_id, delivery.tokens))
        self._later(self._release(model, delivery.request_id))

    async def cancel(self, request_id: str, delivered_tokens: int) -> None:
        """The client got `delivered_tokens` and will not get the rest of its response (`end_for_client`). Waits
        out a Redis outage however long: a request left uncancelled would run, and be billed, for nobody. Until it
        is done, the journal keeps it for the next gateway on this host, should this one die."""
        error = p.ErrorBody(message="the request was cancelled: its client no longer follows it", type="server_error",
                            code="cancelled", status=499)
        await self._through_outage(lambda: end_for_client(self.redis, request_id, error, delivered_tokens,
                                                          self.streams), give_up_s=math.inf)
        self.journal.closed(request_id)

    async def _release(self, model: str, request_id: str) -> None:
        """Its place in the queue given back, after a Redis restart too (else held until the request times out)."""
        await self._through_outage(lambda: self.admission.release(model, request_id))

    async def _through_outage(self, step: Callable[[], Awaitable[None]], give_up_s: float | None = None) -> None:
        outage = Outage(self.streams.reply_ttl_s if give_up_s is None else give_up_s)
        while True:
            try:
                return await step()
            except RECONNECTING as exc:
                await outage.wait(self.redis, exc)

    def _later(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._done_later)

    def _done_later(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()):
            log.error("a request's clean-up failed: %s", exc)


@dataclass
class _Delivery:
    """What one client got of its response so far, journaled as it goes (`gateway.delivery_journal`)."""

    request_id: str
    journal: DeliveryJournal | UnjournaledDeliveries
    tokens: int = 0  # completion tokens sent, every choice's
    done: bool = False  # the stream reached its end (not cut short by the client)

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        self.journal.delivered(self.request_id, self.tokens)


class _RelayedStream(StreamingResponse):
    """Runs `on_close` however the response ends: a generator that never started (the client left before
    the first byte) runs no `finally`, and its admission slot and cancellation would be lost."""

    def __init__(self, *args, on_close, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _ClientGone(Exception):
    pass


@contextlib.contextmanager
def _timeouts_answered():
    """A reply that stopped coming (`follow_replies`' timeouts) as the 504 its client gets."""
    try:
        yield
    except DeadlineExceeded:
        raise RequestError(p.deadline_exceeded()) from None
    except TimeoutError as exc:
        raise RequestError(p.ErrorBody(message=str(exc), type="server_error", code="timeout", status=504)) from None


def redis_unavailable(exc: BaseException) -> p.ErrorBody:
    """Redis down, restarting or refusing writes: a request it cut off was cancelled, so a retry is safe."""
    return p.ErrorBody(message=f"the request queue (Redis) is unavailable ({exc}); retry shortly",
                       type="server_error", code="service_unavailable", status=503)


async def _unless_client_leaves(work: Awaitable[Response], is_disconnected: Callable[[], Awaitable[bool]],
                                poll_s: float = 0.5) -> Response:
    """`work`, unless the client disconnects first (it waited in the queue, or for a whole response, and
    gave up): then `_ClientGone`, so the request is cancelled rather than generated for nobody."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await is_disconnected():
                raise _ClientGone
    finally:
        task.cancel()
