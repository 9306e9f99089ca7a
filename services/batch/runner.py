"""The Batch API's job (Celery task `RUN_BATCH`, on the low-priority batch queue): runs a batch's lines through
the request stream as the gateway would run them, a few at a time, and writes its output and error files.

Each line becomes the `GenerateRequest` the gateway builds for the same body and key (same parse, same
`to_message`), with SLA class "batch" and `p.BATCH_PRIORITY`, which the engine schedules after interactive
requests. At most `max_in_flight` lines are in the stack at once, and each passes the gateway's admission
(waiting, not failing, while a model's queue is full): batch traffic fills the troughs rather than flooding.

Idempotent: each line's result is recorded by custom_id as it ends (`p.batch_output_key`, `p.batch_errors_key`),
and a line's request id is derived from the batch and custom_id, so a job re-run after a crash skips the lines
answered and follows, rather than resubmits, a line whose request is still in the stack.

The batch's window: at its `expires_at` the job stops its lines in flight (each request is cancelled in the stack)
and expires the batch (`services.batch.store.expire_if_due`): the lines answered stay in its files, the others are
`batch_expired` errors. A job that starts past the deadline (it waited in the queue, or re-runs after a crash)
runs nothing. A result is recorded only while the batch is `in_progress` or `cancelling`, so nothing lands
after an expiry froze the results."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time

import redis.asyncio as aioredis

from services.base import protocol as p
from services.base.redis_client import connect
from services.base.replies import follow_replies, signal_cancel
from services.base.settings import AccountingSettings, CacheSettings, GatewaySettings, RouterSettings, StreamSettings
from services.batch.lease import BatchLease
from services.batch.store import (
    ACTIVE,
    BatchLine,
    expire_if_due,
    input_order,
    line_request_id,
    load_batch,
    load_file,
    read_lines,
    request_counts,
    store_results,
    transition,
)
from services.openai_api.admission import Admission
from services.openai_api.context_window import ContextWindow
from services.openai_api.render import ResponseBuilder
from services.openai_api.schemas import RequestError, cache_mode
from services.tenancy.auth import key_by_hash, prefix_scope
from services.tenancy.budgets import Budgets, Estimator
from services.tenancy.prices import PriceTable
from services.text.prompt_encoder import PromptEncoder

log = logging.getLogger(__name__)
MAX_IN_FLIGHT = 8
BATCH_SLA_CLASS = "batch"
# A line's result, written only while the batch's job may still record (an expiry freezes the results).
_RECORD = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= ARGV[1] and status ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return 1
"""


def run_batch(redis_url: str, batch_id: str, max_in_flight: int = MAX_IN_FLIGHT, lease_s: float = 30.0) -> dict:
    """Runs the batch to its end (or its cancellation); returns its request counts, or {} when another job runs
    it (see batch_lease.py: the job holds a `lease_s` lease on the batch while it runs)."""

    async def main() -> dict:
        redis = connect(redis_url)
        try:
            job = BatchJob(redis, batch_id, max_in_flight)
            return await BatchLease(redis, batch_id, lease_s).hold(job.run) or {}
        finally:
            await redis.aclose()

    return asyncio.run(main())


class BatchJob:
    def __init__(self, redis: aioredis.Redis, batch_id: str, max_in_flight: int):
        self.redis, self.batch_id, self.max_in_flight = redis, batch_id, max_in_flight
        self.window_ended = False  # set when the batch's window ends with lines in flight
        self.gateway, self.streams = GatewaySettings(), StreamSettings()
        tiers = RouterSettings()
        encoder = PromptEncoder()  # shared by the estimate and the admission: each line is tokenized once
        self.admission = Admission(redis, self.gateway, tiers, self.streams.events_max_backlog,
                                   ContextWindow(encoder))
        self.budgets = Budgets(redis, Estimator(redis, PriceTable.load(AccountingSettings().prices_path),
                                                (tiers.small_model, tiers.large_model), encoder=encoder),
                               self.gateway.request_timeout_s)
        self.default_cache_mode = CacheSettings().default_mode

    async def run(self) -> dict:
        batch = await load_batch(self.redis, self.batch_id)
        if batch is None:  # expired before a worker got to it
            log.warning("batch %s is gone", self.batch_id)
            return {}
        batch = await expire_if_due(self.redis, batch)  # its window ended while the job waited: nothing runs
        now = int(time.time())
        started = await transition(self.redis, self.batch_id, ACTIVE, status="in_progress",
                                   in_progress_at=batch["in_progress_at"] or now)
        if started:
            file = await load_file(self.redis, batch["input_file_id"])
            if file is None:
                await self._fail(batch, "file_not_found", f"the input file {batch['input_file_id']} has expired")
                return await request_counts(self.redis, batch)
            await self._run_lines(batch, read_lines(file["content"]))
        batch = await load_batch(self.redis, self.batch_id) or batch
        # at the deadline by this host's timer, even if its clock reads a hair before `expires_at`
        batch = await expire_if_due(self.redis, batch,
                                    max(time.time(), batch["expires_at"]) if self.window_ended else None)
        if batch["status"] in ("in_progress", "cancelling"):
            await self._finalize(batch)
        return await request_counts(self.redis, batch)

    async def _run_lines(self, batch: dict, lines: list[BatchLine]) -> None:
        """Runs the lines not yet answered until they are, the batch is no longer in progress, or its window
        ends (`window_ended`: the lines in flight then are cancelled)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hkeys(p.batch_output_key(self.batch_id))
            pipe.hkeys(p.batch_errors_key(self.batch_id))
            answered = {custom_id for keys in await pipe.execute() for custom_id in keys}
        pending = iter([line for line in lines if line.custom_id not in answered])

        async def lane() -> None:
            # `pending` is shared: each lane takes the next line when its last one ended
            for line in pending:
                if await self._cancelling():
                    return
                await self._record(line, *await self._answer(batch, line))

        lanes = asyncio.gather(*(lane() for _ in range(self.max_in_flight)))
        done, _ = await asyncio.wait([lanes], timeout=max(0.0, batch["expires_at"] - time.time()))
        if not done:  # the window ended first
            self.window_ended = True
            lanes.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lanes

    async def _cancel(self, request_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            signal_cancel(pipe, request_id, self.streams)
            await pipe.execute()

    async def _cancelling(self) -> bool:
        return json.loads(await self.redis.hget(p.batch_key(self.batch_id), "status") or "null") != "in_progress"

    async def _answer(self, batch: dict, line: BatchLine) -> tuple[bool, dict]:
        """(succeeded, the line's output object)."""
        rid = line_request_id(self.batch_id, line.custom_id)
        out = {"id": f"batch_req_{rid}", "custom_id": line.custom_id}
        try:
            body = await self._generate(batch, line, rid)
        except asyncio.CancelledError:
            if self.window_ended:  # stop the request in the stack, so it is neither run nor billed
                await self._cancel(rid)
            raise
        except RequestError as exc:
            return False, {**out, "response": {"status_code": exc.error.status, "request_id": rid,
                                               "body": exc.error.openai()}, "error": None}
        except TimeoutError as exc:  # the stack may still be running it: stop it, so it is neither run nor billed
            await self._cancel(rid)
            return False, {**out, "response": None, "error": {"code": "timeout", "message": str(exc)}}
        return True, {**out, "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}

    async def _generate(self, batch: dict, line: BatchLine, rid: str) -> dict:
        """As `Gateway.generate` builds and relays the request: the key's budget holds for batch lines too (a
        line that does not fit fails with insufficient_quota); its per-minute rate limits, which pace
        interactive traffic, do not."""
        key, req = batch["key"], line.request()
        message = req.to_message(rid, key["name"], prefix_scope(key["name"], key.get("prefix_group")))
        message.deadline = batch["expires_at"]  # the batch's window: nobody wants a line's answer after it
        message.api_key_id = key["hash"]
        message.cache_mode = cache_mode(req.cache, None, key["cache_mode"], self.default_cache_mode)
        message.sla_class, message.priority = BATCH_SLA_CLASS, p.BATCH_PRIORITY
        submitted = p.batch_submitted_key(self.batch_id)
        if not await self.redis.hexists(submitted, line.custom_id):  # else sent by a job that died: follow it
            api_key = await key_by_hash(self.redis, key["hash"])
            if api_key is None:  # revoked since the batch was created: nothing more runs on it
                raise RequestError(p.ErrorBody(message="the batch's API key no longer exists", type="invalid_request",
                                               code="invalid_api_key", status=401))
            if api_key.budget_usd is not None:
                await self.budgets.admit(dataclasses.replace(api_key, rpm=None, tpm=None), message)
            try:
                await self._admit(message)
            except (RequestError, asyncio.CancelledError):  # never enqueued: its reservation goes back
                await self.budgets.release(rid)
                raise
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xadd(p.REQUESTS_STREAM, message.encode(), maxlen=self.streams.stream_maxlen, approximate=True)
                pipe.hset(submitted, line.custom_id, 1)
                pipe.expire(submitted, p.BATCH_TTL_S)
                await pipe.execute()
        try:
            return await self._collect(req, message)
        finally:
            await self.admission.release(req.model, rid)

    async def _admit(self, message: p.GenerateRequest) -> None:
        """The gateway's admission; a full queue or no live worker is waited out (up to the request timeout)."""
        deadline = time.monotonic() + self.gateway.request_timeout_s
        while True:
            try:
                return await self.admission.admit(message)
            except RequestError as exc:
                if exc.error.code not in ("queue_full", "no_worker") or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(self.gateway.retry_after_s)

    async def _collect(self, req, message: p.GenerateRequest) -> dict:
        """The whole response body, built as the gateway builds a non-streamed one."""
        builder = None
        async for chunk in follow_replies(self.redis, message.request_id, self.gateway.request_timeout_s,
                                          outage_s=self.streams.redis_outage_s):
            if chunk.kind == "error":
                raise RequestError(chunk.error)
            if builder is None:
                prefix = "chatcmpl" if message.kind == "chat" else "cmpl"
                builder = ResponseBuilder(message.kind, f"{prefix}-{message.request_id}", message.created,
                                          chunk.model or message.model, False, req.wants_logprobs)
            if chunk.kind == "delta":
                builder.add(chunk)
            elif chunk.kind == "finished":
                return builder.response(chunk, req.n)
        raise RequestError(p.ErrorBody(message="the reply stream ended early", type="server_error", status=500))

    async def _record(self, line: BatchLine, succeeded: bool, output: dict) -> None:
        key = p.batch_output_key(self.batch_id) if succeeded else p.batch_errors_key(self.batch_id)
        await self.redis.eval(_RECORD, 2, p.batch_key(self.batch_id), key, json.dumps("in_progress"),
                              json.dumps("cancelling"), line.custom_id, json.dumps(output), p.BATCH_TTL_S)

    async def _finalize(self, batch: dict) -> None:
        """The output and error files (lines in input order), then the final status: cancelled if a cancel
        came, else completed."""
        await transition(self.redis, self.batch_id, ("in_progress", "cancelling"), finalizing_at=int(time.time()))
        files = await store_results(self.redis, batch, await input_order(self.redis, batch))
        now = int(time.time())
        if not await transition(self.redis, self.batch_id, ("in_progress",), status="completed", completed_at=now,
                                **files):
            await transition(self.redis, self.batch_id, ("cancelling",), status="cancelled", cancelled_at=now,
                             **files)

    async def _fail(self, batch: dict, code: str, message: str) -> None:
        await transition(self.redis, self.batch_id, ("in_progress",), status="failed", failed_at=int(time.time()),
                         errors={"object": "list", "data": [{"code": code, "message": message, "line": None}]})
