"""The ledger's writer: a consumer group on the completion-events stream. Each batch of events becomes rows
in one database transaction; only after the commit are the events acknowledged (and the tasks' budget
reservations settled), so a crash at any point loses no event and, the request id being unique, a replayed
one duplicates nothing. A janitor takes the pending events of a consumer that died."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from sqlalchemy import Engine
from sqlalchemy.exc import DataError, IntegrityError

from services.accounting import ledger
from services.accounting.metrics import LedgerMetrics
from services.base import protocol as p
from services.base import streams, telemetry
from services.base.redis_client import BLOCK_MS
from services.base.settings import StreamSettings
from services.tenancy.prices import PriceTable
from services.tenancy.sla import SlaPolicy

log = logging.getLogger(__name__)

ACCOUNTING_GROUP = "accounting"
BATCH = 256

# Called with (request id, its list cost) for every recorded task, after the commit: budgets settle there.
Settle = Callable[[str, float], Awaitable[None]]


async def no_settlement(request_id: str, list_cost_usd: float) -> None:
    """For deployments without budgets (and tests of the ledger alone)."""


class LedgerConsumer:
    def __init__(self, redis: aioredis.Redis, engine: Engine, prices: PriceTable, sla: SlaPolicy, consumer_id: str,
                 stream_settings: StreamSettings, settle: Settle = no_settlement, metrics: LedgerMetrics | None = None):
        self.redis, self.engine, self.prices, self.sla = redis, engine, prices, sla
        self.metrics = metrics or LedgerMetrics()
        self.consumer_id, self.streams, self.settle = consumer_id, stream_settings, settle

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`, even in the middle of an outage: a batch cut short by the stop is read again (its events
        stay pending until acknowledged, and a row is never written twice)."""
        await streams.ensure_group(self.redis, p.EVENTS_STREAM, ACCOUNTING_GROUP)
        loops = [asyncio.create_task(streams.restarting(name, loop, log, self.redis))
                 for name, loop in (("ledger reader", self._read_loop), ("ledger janitor", self._janitor_loop))]
        try:
            await stop.wait()
        finally:
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def _read_loop(self) -> None:
        while True:
            await self.write(await streams.read_new(self.redis, p.EVENTS_STREAM, ACCOUNTING_GROUP, self.consumer_id,
                                                    BATCH, BLOCK_MS))

    async def _janitor_loop(self) -> None:
        claimer = streams.StaleClaimer(self.redis, p.EVENTS_STREAM, ACCOUNTING_GROUP, self.consumer_id, self.streams)
        while True:
            await asyncio.sleep(self.streams.janitor_interval_s)
            await self.write(await claimer.claim(BATCH))
            # Once a tick rather than after every batch: three round trips, off the reading path.
            await streams.trim_acknowledged(self.redis, p.EVENTS_STREAM, ACCOUNTING_GROUP, self.streams.events_keep_s)

    async def _one_by_one(self, events: list[p.CompletionEvent], rows: list[dict]):
        """Each row in its own transaction; a refused one goes to the dead-letter stream (with its event, to
        be fixed and replayed by hand) and is acknowledged with the batch. A lost connection is no row's
        fault: that error propagates, and the batch is retried whole."""
        new, kept_events, kept_rows = set(), [], []
        for event, row in zip(events, rows, strict=True):
            try:
                new.update(await asyncio.to_thread(ledger.record, self.engine, [row]))
                kept_events.append(event)
                kept_rows.append(row)
            except (DataError, IntegrityError) as exc:
                log.error("the ledger refused the row of %s: %s", event.request_id, exc)
                letter = p.DeadLetter(request_id=event.request_id, stream=p.EVENTS_STREAM, entry_id="", deliveries=1,
                                      reason=f"ledger refused the row: {exc}"[:500], event=event,
                                      traceparent=event.traceparent)
                await self.redis.xadd(p.DEAD_LETTER_STREAM, letter.encode(), maxlen=self.streams.stream_maxlen,
                                      approximate=True)
        return new, kept_events, kept_rows

    async def write(self, deliveries: list[streams.Delivery]) -> None:
        if not deliveries:
            return
        events, cuts = self._decode(deliveries)
        events = await self._as_delivered(events)
        rows = [ledger.row(event, self.prices, self.sla) for event in events]
        started = time.time()
        try:
            new = set(await asyncio.to_thread(ledger.record, self.engine, rows))
        except (DataError, IntegrityError):  # one row the database refuses must not hold back the others
            new, events, rows = await self._one_by_one(events, rows)
        for recorded in rows:
            if recorded["request_id"] in new:
                self.metrics.count(recorded)
        for event, recorded in zip(events, rows, strict=True):  # the trace's last hop: the task's row committed
            telemetry.record("ledger.record", event.traceparent, started, time.time(), {
                "gen_ai.request.model": event.model, "gen_ai.usage.input_tokens": event.usage.prompt_tokens,
                "gen_ai.usage.output_tokens": event.usage.completion_tokens,
                "tokenfleet.cost.list_usd": float(recorded["list_cost_usd"]),
                "tokenfleet.cost.measured_usd": float(recorded["measured_cost_usd"]),
                "tokenfleet.sla_met": recorded["sla_met"]})
        for recorded in rows:  # every one, not only the new: a replay after a crash settles what the crash missed
            await self.settle(recorded["request_id"], float(recorded["list_cost_usd"]))
        await self._cut(cuts)
        await self.redis.xack(p.EVENTS_STREAM, ACCOUNTING_GROUP, *[d.entry_id for d in deliveries])
        log.debug("ledger: %d events, %d new rows", len(deliveries), len(new))

    def _decode(self, deliveries: list[streams.Delivery]):
        """The completion events, and the delivery cuts."""
        events, cuts = [], []
        for delivery in deliveries:
            try:
                event = p.decode_event(delivery.fields)
            except ValueError:  # not an event of ours: acknowledged with the rest, logged, never retried
                log.error("dropping malformed completion event %s", delivery.entry_id)
                continue
            if isinstance(event, p.DeliveryCut):
                cuts.append(event)
            else:
                events.append(event)
        return events, cuts

    async def _as_delivered(self, events: list[p.CompletionEvent]) -> list[p.CompletionEvent]:
        """Each event as its client got it: a gateway that ended the response short said how many tokens its
        client got (`p.delivered_key`), maybe before the event was written."""
        if not events:
            return events
        counts = await self.redis.mget([p.delivered_key(event.request_id) for event in events])
        return [ledger.as_delivered(event, None if count is None else int(count))
                for event, count in zip(events, counts, strict=True)]

    async def _cut(self, cuts: list[p.DeliveryCut]) -> None:
        """Bills the rows of requests whose clients got less than their events say (a cut whose request has no
        row yet needs nothing more: the row, when written, bills from `p.delivered_key`), and settles their budgets
        again with the new cost."""
        if not cuts:  # most batches: no thread hop, no transaction
            return
        changed = await asyncio.to_thread(ledger.cut, self.engine, {c.request_id: c.delivered_tokens for c in cuts},
                                          self.prices)
        for row in changed:
            if row.was_ok is not None:
                self.metrics.cut(row.was_ok)
            await self.settle(row.request_id, float(row.list_cost_usd))
