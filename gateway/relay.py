"""Enqueue one admitted request and relay its reply stream to the client, whole or as SSE.

The response starts only after the worker's first message ("started" or "error"), so a request the worker
refuses (prompt past the context) still gets its 400 rather than an error inside a 200 stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.admission import Admission
from gateway.idempotency import FirstRequest, Idempotency
from gateway.render import ResponseBuilder
from gateway.schemas import ChatCompletionRequest, RequestError
from services import protocol as p
from services.settings import GatewaySettings, StreamSettings
from services.streams import follow_replies


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else p.dumps(obj)}\n\n"


class Relay:
    def __init__(self, redis: aioredis.Redis, admission: Admission, idempotency: Idempotency,
                 settings: GatewaySettings, stream_settings: StreamSettings):
        self.redis, self.admission, self.idempotency = redis, admission, idempotency
        self.settings, self.streams = settings, stream_settings
        self._background: set[asyncio.Task] = set()

    async def run(self, req, message: p.GenerateRequest, idempotency_record: tuple[str, str] | None) -> Response:
        """`idempotency_record`: (key hash, Idempotency-Key) under which to keep the whole response."""
        rid = message.request_id
        await self.admission.admit(req.model, rid)
        try:
            await self.redis.xadd(p.REQUESTS_STREAM, message.encode(), maxlen=self.streams.stream_maxlen,
                                  approximate=True)
            return await self._respond(req, rid, message.created, owner=True, store=idempotency_record)
        except BaseException:
            self._later(self.admission.release(req.model, rid))
            raise

    async def replay(self, req, first: FirstRequest) -> Response:
        """The first request's response for a repeated Idempotency-Key: stored, or followed from its start."""
        if first.result is not None:
            return JSONResponse(first.result)
        return await self._respond(req, first.request_id, first.created, owner=False, store=None)

    async def _respond(self, req, rid: str, created: int, owner: bool, store) -> Response:
        replies = follow_replies(self.redis, rid, self.settings.request_timeout_s)
        first = await self._first(replies)
        kind = "chat" if isinstance(req, ChatCompletionRequest) else "completion"
        builder = ResponseBuilder(kind, f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rid}", created, first.model,
                                  req.include_usage, req.wants_logprobs)
        if req.stream:
            return StreamingResponse(self._events(builder, replies, req, rid, owner), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        body = await self._collect(builder, replies, req.n)
        if owner:
            self._later(self.admission.release(req.model, rid))
        if store is not None:
            await self.idempotency.store_result(*store, body)
        return JSONResponse(body)

    async def _first(self, replies: AsyncIterator[p.ReplyChunk]) -> p.ReplyChunk:
        try:
            first = await anext(replies)
        except TimeoutError as exc:
            raise RequestError(p.ErrorBody(message=str(exc), type="server_error", code="timeout", status=504)) from None
        if first.kind == "error":
            raise RequestError(first.error)
        return first

    async def _collect(self, builder: ResponseBuilder, replies: AsyncIterator[p.ReplyChunk], n: int) -> dict:
        async for chunk in replies:
            if chunk.kind == "delta":
                builder.add(chunk)
            elif chunk.kind == "error":
                raise RequestError(chunk.error)
            elif chunk.kind == "finished":
                return builder.response(chunk, n)
        raise RequestError(p.ErrorBody(message="the reply stream ended early", type="server_error", status=500))

    async def _events(self, builder: ResponseBuilder, replies: AsyncIterator[p.ReplyChunk], req, rid: str,
                      owner: bool) -> AsyncIterator[str]:
        done = False
        try:
            for obj in builder.role_chunks(req.n):
                yield sse(obj)
            async for chunk in replies:
                if chunk.kind == "delta":
                    for obj in builder.delta_chunks(chunk):
                        yield sse(obj)
                elif chunk.kind == "error":
                    yield sse(chunk.error.openai())
                elif chunk.kind == "finished":
                    yield sse(builder.final_chunk(chunk))
            done = True
        except TimeoutError as exc:
            yield sse(p.ErrorBody(message=str(exc), type="server_error", code="timeout").openai())
            done = True
        finally:
            # The client may have gone: this generator is being cancelled, so the clean-up runs as its own task.
            if owner:
                if not done:
                    self._later(self.cancel(rid))
                self._later(self.admission.release(req.model, rid))
        yield sse("[DONE]")

    async def cancel(self, request_id: str) -> None:
        """Reaches a worker that holds the request now (pub/sub) or takes it later (the key)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(p.cancel_key(request_id), 1, ex=self.streams.reply_ttl_s)
            pipe.publish(p.CANCEL_CHANNEL, request_id)
            await pipe.execute()

    def _later(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

