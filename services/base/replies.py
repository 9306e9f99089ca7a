"""Reply streams: a request's chunks from its worker to whoever follows it (the gateway, a batch job), the
worker's coalescing publisher, and the cancel signal that travels the other way."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from . import protocol as p
from .redis_client import BLOCK_MS, RECONNECTING, Outage
from .settings import StreamSettings

T = TypeVar("T")


def signal_cancel(pipe, request_id: str, settings: StreamSettings) -> None:
    """Queues on `pipe` what stops a request wherever it is: pub/sub reaches a worker that holds it now, the
    key one that takes it later."""
    pipe.set(p.cancel_key(request_id), 1, ex=settings.reply_ttl_s)
    pipe.publish(p.CANCEL_CHANNEL, request_id)


# A client's request ends short of its response (see `end_for_client`). KEYS: reply stream, cancel key, events
# stream, delivered key. ARGV: field, ttl, the error chunk, the cut, the cancel channel, the request id, the
# delivered count, its ttl.
_END_FOR_CLIENT = """
redis.call('SET', KEYS[4], ARGV[7], 'EX', ARGV[8])
redis.call('XADD', KEYS[3], '*', ARGV[1], ARGV[4])
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last == 1 then
  local fields = last[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == ARGV[1] and cjson.decode(fields[i + 1])['kind'] == 'finished' then return 'cut' end
  end
end
redis.call('SET', KEYS[2], 1, 'EX', ARGV[2])
redis.call('PUBLISH', ARGV[5], ARGV[6])
redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 'cancelled'
"""


async def end_for_client(redis: aioredis.Redis, request_id: str, error: p.ErrorBody, delivered_tokens: int,
                         settings: StreamSettings) -> str:
    """The client got `delivered_tokens` completion tokens and will not get the rest of a request's response (it
    left, or its gateway stopped waiting, or died), in one atomic step: the count goes to the ledger (a
    `DeliveryCut`, and `p.delivered_key` for an event not written yet), and a request still running is cancelled
    (`signal_cancel`) and its reply stream closed with `error` for anyone else following it. A worker's finish is
    vetoed by the cancel key (`streams.ack_then_add`), so of the two, whichever lands first decides whether the
    request was cancelled or finished ("cut", returned then; else "cancelled")."""
    chunk = p.ReplyChunk(kind="error", error=error)
    cut = p.DeliveryCut(request_id=request_id, delivered_tokens=delivered_tokens)
    return await redis.eval(_END_FOR_CLIENT, 4, p.reply_stream(request_id), p.cancel_key(request_id),
                            p.EVENTS_STREAM, p.delivered_key(request_id), p.FIELD, settings.reply_ttl_s,
                            chunk.encode()[p.FIELD], cut.encode()[p.FIELD], p.CANCEL_CHANNEL, request_id,
                            delivered_tokens, p.DELIVERED_TTL_S)


# A chunk for a request's reply stream, unless the request was cancelled (its cancel key is set): a worker's delta
# written after its client's end (`end_for_client`) closed the stream would follow that error, and be counted as sent
# to a client that had gone. KEYS: reply stream, cancel key. ARGV: field, chunk, ttl.
_ADD_UNLESS_CANCELLED = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""


def add_reply(pipe, request_id: str, chunk: p.ReplyChunk, settings: StreamSettings) -> None:
    pipe.eval(_ADD_UNLESS_CANCELLED, 2, p.reply_stream(request_id), p.cancel_key(request_id), p.FIELD,
              chunk.encode()[p.FIELD], settings.reply_ttl_s)


class ReplyPublisher:
    """Writes reply chunks, coalescing what every request publishes in one event-loop tick into a single
    pipelined round trip: a worker publishes a delta per request per engine step, and a round trip each kept
    its event loop too busy to take new requests promptly (a few ms of added latency at 20 req/s)."""

    def __init__(self, redis: aioredis.Redis, settings: StreamSettings):
        self.redis, self.settings = redis, settings
        self._pending: list[tuple[str, p.ReplyChunk]] = []
        self._flush: asyncio.Task | None = None  # the write still taking chunks
        self._writes: set[asyncio.Task] = set()  # writes not yet done
        self._order = asyncio.Lock()
        # Requests a write of which failed (Redis went away): none of their later chunks may land after the
        # gap, or a client would take a later token for the next one. Their serving resumes from the stream.
        self._broken: set[str] = set()

    def reset(self, request_id: str) -> None:
        """A request's serving starts (again) from what its reply stream holds, or ends: its failed writes
        are forgotten."""
        self._broken.discard(request_id)

    def _check(self, request_id: str) -> None:
        if request_id in self._broken:
            raise RedisConnectionError(f"an earlier reply write of request {request_id} failed")

    def publish_nowait(self, request_id: str, chunks: list[p.ReplyChunk]) -> asyncio.Task:
        """Queues the chunks; the returned write puts them in Redis after everything queued before them."""
        self._pending.extend((request_id, chunk) for chunk in chunks)
        if self._flush is None:
            self._flush = asyncio.create_task(self._write())
            self._writes.add(self._flush)
            self._flush.add_done_callback(self._writes.discard)
        return self._flush

    async def publish(self, request_id: str, chunks: list[p.ReplyChunk]) -> None:
        """Returns once the chunks, and everything queued before them, are in Redis."""
        self._check(request_id)
        # shielded: a cancelled publisher must not cancel the write that carries the others' chunks too
        await asyncio.shield(self.publish_nowait(request_id, chunks))

    async def finish(self, request_id: str, commit: Callable[[], Awaitable[T]]) -> T:
        """Runs `commit`, one atomic write of a request's last chunks with its completion event and acknowledgement
        (`streams.ack_then_add`), after every chunk queued before it: a crash or a cancel at any moment leaves all
        of them or none, never a finished reply whose event is missing from the ledger."""
        if self._flush is not None:  # chunks queued and not yet taken by a write go first
            await asyncio.shield(self._flush)
        self._check(request_id)
        async with self._order:
            return await commit()

    async def flushed(self) -> None:
        """Returns once everything published so far is written (before handing work back)."""
        while self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def _write(self) -> None:
        await asyncio.sleep(0)  # the other requests woken by the same engine step add theirs first
        batch, self._pending, self._flush = self._pending, [], None
        async with self._order, self.redis.pipeline(transaction=False) as pipe:  # one write at a time: FIFO
            for request_id, chunk in batch:
                add_reply(pipe, request_id, chunk, self.settings)
            try:
                await pipe.execute()
            except BaseException:
                self._broken.update(request_id for request_id, _ in batch)
                raise


async def reply_history(redis: aioredis.Redis, request_id: str) -> list[tuple[str, p.ReplyChunk]]:
    entries = await redis.xrange(p.reply_stream(request_id))
    return [(entry_id, p.decode(p.ReplyChunk, fields)) for entry_id, fields in entries]


def sent_usage(chunks: Iterable[p.ReplyChunk]) -> p.Usage:
    """What a reply stream shows its client was sent, what a request that ends unfinished is billed: the prompt as
    its worker counted it, and each choice's tokens once (a resumed worker's repeats share their positions)."""
    prompt_tokens, ends = 0, {}
    for chunk in chunks:
        if chunk.kind == "started" and not prompt_tokens:
            prompt_tokens = chunk.prompt_tokens or 0
        elif chunk.kind == "delta":
            ends[chunk.index] = max(ends.get(chunk.index, 0), chunk.position + len(chunk.token_ids))
    return p.Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(ends.values()))


async def sent_usage_of(redis: aioredis.Redis, request_id: str) -> p.Usage:
    return sent_usage(chunk for _, chunk in await reply_history(redis, request_id))


async def _by(hard: float, work: Awaitable[T]) -> T:
    """`work`, cut off with asyncio's TimeoutError at the monotonic time `hard` (math.inf: never)."""
    return await asyncio.wait_for(work, None if hard == math.inf else max(0.0, hard - time.monotonic()))


async def _read(redis: aioredis.Redis, key: str, last_id: str, block_ms: int, hard: float, outage: Outage):
    """One blocking read of a reply stream; None when it timed out, or Redis failed (and answers again) first."""
    try:
        reply = await _by(hard, redis.xread({key: last_id}, block=block_ms))
    except TimeoutError:  # asyncio's: Redis did not answer before the deadline
        return None
    except RECONNECTING as exc:
        with contextlib.suppress(TimeoutError):
            await _by(hard, outage.wait(redis, exc))
        return None
    outage.over()
    return reply


class DeadlineExceeded(TimeoutError):
    """The request's deadline (`GenerateRequest.deadline`) passed before its reply ended."""


async def follow_replies(redis: aioredis.Redis, request_id: str, timeout_s: float, last_id: str = "0-0",
                         outage_s: float = 60.0, deadline: float | None = None) -> AsyncIterator[p.ReplyChunk]:
    """Reply chunks as they arrive, each choice's tokens exactly once (a resumed worker may repeat what
    the dead one published; positions tell). Ends after "finished" or "error"; TimeoutError if silent for
    `timeout_s`, DeadlineExceeded once `deadline` (seconds since the epoch) passes, whatever Redis is doing.
    An unreachable Redis is waited out for `outage_s` (the reading resumes where it stopped, and the worker
    resumes from what the stream holds), then its error is raised."""
    key, next_position, outage = p.reply_stream(request_id), {}, Outage(outage_s)
    silent_until = time.monotonic() + timeout_s
    hard = math.inf if deadline is None else time.monotonic() + (deadline - time.time())
    while True:
        now = time.monotonic()
        if now >= hard:
            raise DeadlineExceeded(f"the deadline of request {request_id} passed")
        wait_ms = int(max(1.0, (min(silent_until, hard) - now) * 1000))
        reply = await _read(redis, key, last_id, min(wait_ms, BLOCK_MS), hard, outage)
        if not reply:
            if time.monotonic() >= silent_until:
                raise TimeoutError(f"no reply for request {request_id} within {timeout_s:.0f} s")
            continue
        silent_until = time.monotonic() + timeout_s
        for entry_id, fields in reply[0][1]:
            last_id = entry_id
            chunk = p.decode(p.ReplyChunk, fields)
            if chunk.kind == "delta":
                expected = next_position.get(chunk.index, 0)
                if chunk.position < expected:
                    continue
                next_position[chunk.index] = chunk.position + len(chunk.token_ids)
            yield chunk
            if chunk.kind in ("finished", "error"):
                return
