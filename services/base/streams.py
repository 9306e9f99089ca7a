"""Consumer-group plumbing shared by the router and the workers: groups, claiming a dead consumer's
entries, forwarding, dead-lettering, trimming. Reply streams are `replies.py`'s."""

from __future__ import annotations

import asyncio
import enum
import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from . import protocol as p
from .redis_client import as_text, waited_for_redis
from .replies import add_reply, sent_usage_of
from .settings import StreamSettings


async def ensure_group(redis: aioredis.Redis, stream: str, group: str) -> None:
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


@dataclass
class Delivery:
    stream: str
    entry_id: str
    fields: dict
    deliveries: int  # as Redis counts them, hand-backs excluded
    claimed: bool = False  # taken from another consumer: its work may be partly done


async def read_new(redis: aioredis.Redis, stream: str | list[str], group: str, consumer: str, count: int,
                   block_ms: int | None) -> list[Delivery]:
    """New entries of one stream or several (one round trip); `block_ms` None: do not wait."""
    names = [stream] if isinstance(stream, str) else stream
    reply = await redis.xreadgroup(group, consumer, dict.fromkeys(names, ">"), count=count, block=block_ms)
    return [Delivery(name, entry_id, fields, 1) for name, entries in reply or [] for entry_id, fields in entries]


async def unread(redis: aioredis.Redis, stream: str, group: str, limit: int = 1000) -> int:
    """Entries of `stream` not yet delivered to `group` (up to `limit`): a worker's inbox backlog, which
    its in-flight count does not show. (Redis 7's XINFO GROUPS `lag` says it in one call; 6.2 has no lag.)"""
    groups = [g for g in await redis.xinfo_groups(stream) if g["name"] == group] if await redis.exists(stream) else []
    if not groups:
        return 0
    last = groups[0]["last-delivered-id"]
    return len(await redis.xrange(stream, min=f"({last}", count=limit))


class StaleClaimer:
    """Takes entries pending longer than `claim_idle_ms` without their owner refreshing them (see `refresh`):
    the owner died. Walks the pending list with XAUTOCLAIM's cursor, so a few entries near its start cannot
    hide the rest; entries trimmed from the stream while pending (Redis 6.2 returns them empty) are dropped."""

    def __init__(self, redis: aioredis.Redis, stream: str, group: str, consumer: str, settings: StreamSettings):
        self.redis, self.stream, self.group, self.consumer, self.settings = redis, stream, group, consumer, settings
        self.cursor = "0-0"

    async def claim(self, count: int) -> list[Delivery]:
        reply = await self.redis.xautoclaim(self.stream, self.group, self.consumer, self.settings.claim_idle_ms,
                                            self.cursor, count=count)
        self.cursor, entries = reply[0], reply[1]
        gone = [entry_id for entry_id, fields in entries if fields is None]
        if gone:
            await self.redis.xack(self.stream, self.group, *gone)
        claimed = [(entry_id, fields) for entry_id, fields in entries if fields is not None]
        deliveries = []
        for entry_id, fields in claimed:  # the count after this claim, which XAUTOCLAIM added
            info = await self.redis.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
            deliveries.append(Delivery(self.stream, entry_id, fields, info[0]["times_delivered"] if info else 1,
                                       claimed=True))
        return deliveries


# Refresh only what this consumer still owns: a plain XCLAIM would take back an entry a janitor has
# already given to another consumer (after this one stalled), and two workers would serve one request.
_REFRESH = """
local lost = {}
for i = 3, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if entry[1] and entry[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""


async def refresh(redis: aioredis.Redis, stream: str, group: str, consumer: str, entry_ids: list[str]) -> list[str]:
    """Reset the idle time of entries this consumer still works on, so no janitor takes them (JUSTID leaves
    the delivery count alone). Returns the ids it no longer owns: another consumer serves them now."""
    if not entry_ids:
        return []
    return await redis.eval(_REFRESH, 1, stream, group, consumer, *entry_ids)


# Add messages to streams only if this consumer's acknowledgement of `entry_id` is the one that counts: a
# router that stalled past `claim_idle_ms` must not forward (or answer from the cache) what another router
# already did. KEYS: the source, N targets, then a registry set (an inbox's: its adopters find it there) when
# ARGV[5] names a member, then a veto key when ARGV[6] is 1 (its existence stops everything: a cancel). ARGV:
# group, entry id, N, field, registry member or "", veto?, then per target: maxlen (0: none), ttl (0: none), the
# message.
_ACK_THEN_ADD = """
if ARGV[6] == '1' and redis.call('EXISTS', KEYS[#KEYS]) == 1 then return 0 end
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return false end
local n = tonumber(ARGV[3])
if ARGV[5] ~= '' then redis.call('SADD', KEYS[n + 2], ARGV[5]) end
for i = 1, n do
  local base = 6 + 3 * (i - 1)
  local maxlen, ttl = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2])
  if maxlen > 0 then
    redis.call('XADD', KEYS[1 + i], 'MAXLEN', '~', maxlen, '*', ARGV[4], ARGV[base + 3])
  else
    redis.call('XADD', KEYS[1 + i], '*', ARGV[4], ARGV[base + 3])
  end
  if ttl > 0 then redis.call('EXPIRE', KEYS[1 + i], ttl) end
end
return 1
"""


class Outcome(enum.Enum):
    ADDED = "added"
    ACKNOWLEDGED_BEFORE = "acknowledged before"  # another consumer (or an earlier call) did it
    VETOED = "vetoed"  # the veto key exists: nothing acknowledged, nothing added


@dataclass(frozen=True)
class Addition:
    stream: str
    message: p.Message
    maxlen: int = 0  # approximate trim; 0: none
    ttl_s: int = 0  # expire the stream after this write; 0: never


def final_replies(request_id: str, chunks: list[p.ReplyChunk], event: p.CompletionEvent,
                  settings: StreamSettings) -> list[Addition]:
    """A request's last reply chunks and its completion event, as `ack_then_add` writes them in one step."""
    additions = [Addition(p.reply_stream(request_id), chunk, ttl_s=settings.reply_ttl_s) for chunk in chunks]
    additions.append(Addition(p.EVENTS_STREAM, event))  # never trimmed by length: see `add_event`
    return additions


async def expire(redis: aioredis.Redis, source: str, group: str, entry_id: str, request: p.GenerateRequest,
                 settings: StreamSettings) -> Outcome:
    """A request whose deadline passed before anything ran it: acknowledged, its client told, its row `expired`."""
    chunk = p.ReplyChunk(kind="error", error=p.deadline_exceeded())
    event = p.CompletionEvent.abandoned(request, "expired", worker_id="")
    return await ack_then_add(redis, source, group, entry_id, final_replies(request.request_id, [chunk], event,
                                                                            settings))


async def ack_then_add(redis: aioredis.Redis, source: str, group: str, entry_id: str, additions: list[Addition],
                       registry: tuple[str, str] | None = None, veto: str | None = None) -> Outcome:
    """Acknowledge `entry_id` and make the additions, atomically and once, unless the key `veto` exists.
    `registry`: (set, member) to add to in the same step."""
    keys = [source, *(a.stream for a in additions), *([registry[0]] if registry else []), *([veto] if veto else [])]
    args = [group, entry_id, len(additions), p.FIELD, registry[1] if registry else "", 1 if veto else 0]
    for addition in additions:
        args += [addition.maxlen, addition.ttl_s, addition.message.encode()[p.FIELD]]
    done = await redis.eval(_ACK_THEN_ADD, len(keys), *keys, *args)
    return Outcome.ACKNOWLEDGED_BEFORE if done is None else Outcome.ADDED if done else Outcome.VETOED


async def forward(redis: aioredis.Redis, source: str, group: str, entry_id: str, target: str, message: p.Message,
                  settings: StreamSettings, registry: tuple[str, str] | None = None) -> bool:
    """Move an entry to `target` once (see `ack_then_add`); False if it was moved before."""
    added = await ack_then_add(redis, source, group, entry_id, [Addition(target, message, settings.stream_maxlen)],
                               registry)
    return added is Outcome.ADDED


# Delete an adopted inbox once nothing in it is pending or unread, atomically: a router's XADD lands either
# before (and the inbox stays) or after (and recreates it, and registers it again: see `forward`).
_RETIRE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[2], ARGV[2])
  return 1
end
local last_generated
local info = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then last_generated = info[i + 1] end
end
local grouped = false
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local fields = {}
  for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
  if fields['name'] == ARGV[1] then
    grouped = true
    if fields['pending'] > 0 or fields['last-delivered-id'] ~= last_generated then return 0 end
  end
end
if not grouped and redis.call('XLEN', KEYS[1]) > 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
return 1
"""


async def retire(redis: aioredis.Redis, stream: str, group: str, registry: str, member: str) -> bool:
    """Deletes `stream` and removes `member` from the `registry` set if the group has nothing left in it."""
    return bool(await redis.eval(_RETIRE, 2, stream, registry, group, member))


async def restarting(name: str, loop, log, redis: aioredis.Redis, backoff_s: float = 1.0) -> None:
    """Runs a service's background loop, restarting it after an error (a Redis restart, a timeout) instead
    of letting it die silently while the process looks alive. An unreachable Redis is waited out with a line
    as it goes and one as it comes back, not a traceback per retry."""
    while True:
        try:
            return await loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not await waited_for_redis(redis, exc, name, log):
                log.exception("%s failed; restarting in %.0f s", name, backoff_s)
                await asyncio.sleep(backoff_s)


async def hand_back(redis: aioredis.Redis, stream: str, group: str, consumer: str, entry_ids: list[str],
                    settings: StreamSettings) -> None:
    """Mark entries as long idle so the next janitor pass of any live consumer takes them (graceful drain).
    A drain is no failure of the request: its delivery count is lowered so the next claim restores it, and
    a long request spanning a few rolling restarts is not dead-lettered for them."""
    for entry_id in entry_ids:
        info = await redis.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
        if info and info[0]["consumer"] == consumer:
            await redis.xclaim(stream, group, consumer, 0, [entry_id], idle=settings.claim_idle_ms * 10,
                               retrycount=max(0, info[0]["times_delivered"] - 1), justid=True)


async def dead_letter(redis: aioredis.Redis, group: str, delivery: Delivery, reason: str,
                      request: p.GenerateRequest | None, settings: StreamSettings) -> None:
    """`request` None: the entry did not decode; its client is still told when its request id can be read."""
    request_id = request.request_id if request else _request_id_of(delivery.fields)
    sent = await sent_usage_of(redis, request_id) if request is not None else None  # its client got those tokens
    letter = p.DeadLetter(request_id=request_id or "", stream=delivery.stream, entry_id=delivery.entry_id,
                          deliveries=delivery.deliveries, reason=reason, request=request,
                          traceparent=request.traceparent if request else None)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.xadd(p.DEAD_LETTER_STREAM, letter.encode(), maxlen=settings.stream_maxlen, approximate=True)
        pipe.xack(delivery.stream, group, delivery.entry_id)
        if request is not None:
            add_event(pipe, p.CompletionEvent.abandoned(request, "dead-lettered", worker_id="", usage=sent))
        if request_id:
            error = p.ErrorBody(message=f"request failed after {delivery.deliveries} deliveries: {reason}",
                                type="server_error", code="dead_letter", status=500)
            add_reply(pipe, request_id, p.ReplyChunk(kind="error", error=error), settings)
        await pipe.execute()


def _request_id_of(fields: dict) -> str | None:
    """The request id of an entry that does not decode as a request, if it has a readable one."""
    try:
        request_id = json.loads(p.raw_message(fields)).get("request_id")
    except (TypeError, ValueError, AttributeError):
        return None
    return request_id if isinstance(request_id, str) and request_id else None


async def dead_letter_exhausted(redis: aioredis.Redis, group: str, claimed: list[Delivery],
                                settings: StreamSettings) -> list[Delivery]:
    """Claimed requests delivered more than `max_deliveries` times go to the dead-letter stream (their client
    gets an error); returns the others, to serve."""
    fresh = []
    for delivery in claimed:
        if delivery.deliveries <= settings.max_deliveries:
            fresh.append(delivery)
            continue
        try:
            request = p.decode(p.GenerateRequest, delivery.fields)
        except ValueError:
            request = None
        await dead_letter(redis, group, delivery, "its workers kept failing", request, settings)
    return fresh


def add_event(pipe, event: p.CompletionEvent) -> None:
    """Never trimmed by length: the accounting service trims what it has recorded (`trim_acknowledged`), so
    events pile up rather than vanish while it is down, and admission refuses work past a backlog bound."""
    pipe.xadd(p.EVENTS_STREAM, event.encode())


async def trim_acknowledged(redis: aioredis.Redis, stream: str, group: str, keep_s: float) -> int:
    """Deletes `stream`'s entries that `group` has acknowledged, except those of the last `keep_s` seconds
    (recent history for whoever inspects it; entry ids are times); never an entry the group has not read or
    still holds pending. Returns how many it deleted."""
    info = next((g for g in await redis.xinfo_groups(stream) if as_text(g["name"]) == group), None)
    if info is None:
        return 0
    summary = await redis.xpending(stream, group)
    unread = _next_id(as_text(info["last-delivered-id"]))
    bound = min(as_text(summary["min"]), unread, key=_id_key) if summary["pending"] else unread
    recent = f"{int((time.time() - keep_s) * 1000)}-0"
    return await redis.xtrim(stream, minid=min(bound, recent, key=_id_key), approximate=False)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def _next_id(entry_id: str) -> str:
    ms, seq = _id_key(entry_id)
    return f"{ms}-{seq + 1}"
