"""A response-cache hit, answered on the request's reply stream as a worker would answer it (started, one
delta per choice, finished), so the gateway serves it through its normal path, streaming or not; with the
completion event that lets the ledger price it, in one step with the request's acknowledgement and only if
that acknowledgement counts (another router that took the entry over answers nothing twice)."""

from __future__ import annotations

import redis.asyncio as aioredis

from cache.response_cache import CacheLookup
from services.base import protocol as p
from services.base import streams
from services.base.settings import StreamSettings

CACHE_WORKER = "response-cache"  # the worker_id of answers that no worker computed


async def answer_from_cache(redis: aioredis.Redis, entry_id: str, request: p.GenerateRequest, hit: CacheLookup,
                            settings: StreamSettings) -> streams.Outcome:
    completion, rid = hit.completion, request.request_id
    model = request.routing.model
    # No worker computed this answer: every prompt token counts as cached, and no guess was scored.
    usage = completion.usage.model_copy(update={"cached_tokens": completion.usage.prompt_tokens,
                                                "draft_tokens": 0, "accepted_draft_tokens": 0})
    timing = p.Timing.unserved(request.enqueued_at)
    chunks = [p.ReplyChunk(kind="started", worker_id=CACHE_WORKER, model=model, prompt_tokens=usage.prompt_tokens,
                           cache=hit.result, traceparent=request.traceparent)]
    chunks += [p.ReplyChunk(kind="delta", worker_id=CACHE_WORKER, index=i, token_ids=c.token_ids, text=c.text,
                            finish_reason=c.finish_reason) for i, c in enumerate(completion.choices)]
    chunks.append(p.ReplyChunk(kind="finished", worker_id=CACHE_WORKER, model=model, usage=usage, timing=timing,
                               cache=hit.result))
    event = p.CompletionEvent(request_id=rid, model=model, worker_id=CACHE_WORKER, api_key_name=request.api_key_name,
                              api_key_id=request.api_key_id,
                              user=request.user, finish_reasons=[c.finish_reason for c in completion.choices],
                              usage=usage, timing=timing, routing=request.routing, sla_class=request.sla_class,
                              enqueued_at=request.enqueued_at, traceparent=request.traceparent)
    additions = streams.final_replies(rid, chunks, event, settings)
    # Vetoed by a cancel (its client left while it queued): then it goes on to a worker, which ends it cancelled.
    return await streams.ack_then_add(redis, p.REQUESTS_STREAM, p.ROUTER_GROUP, entry_id, additions,
                                      veto=p.cancel_key(rid))
