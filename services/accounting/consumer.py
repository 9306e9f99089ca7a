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

from services import protocol as p
from services import streams, telemetry
from services.accounting import ledger
from services.accounting.metrics import LedgerMetrics
from services.accounting.prices import PriceTable
from services.accounting.sla import SlaPolicy
from services.redis_client import BLOCK_MS
from services.settings import StreamSettings

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
        await streams.ensure_group(self.redis, p.EVENTS_STREAM, ACCOUNTING_GROUP)
        janitor = asyncio.create_task(streams.restarting("ledger janitor", self._janitor_loop, log))
        try:
            while not stop.is_set():
                await streams.restarting("ledger reader", self._read_once, log)
        finally:
            janitor.cancel()

    async def _read_once(self) -> None:
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
        events, rows, cuts = self._decode(deliveries)
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
        unrecorded = await self._cut(cuts)
        if done := [d.entry_id for d in deliveries if d.entry_id not in unrecorded]:
            await self.redis.xack(p.EVENTS_STREAM, ACCOUNTING_GROUP, *done)
        log.debug("ledger: %d events, %d new rows", len(deliveries), len(new))

    def _decode(self, deliveries: list[streams.Delivery]):
        """The completion events and their rows, and the delivery cuts (entry id -> request id, deliveries)."""
        events, rows, cuts = [], [], {}
        for delivery in deliveries:
            try:
                event = p.decode_event(delivery.fields)
                if isinstance(event, p.DeliveryCut):
                    cuts[delivery.entry_id] = (event.request_id, delivery.deliveries)
                    continue
                rows.append(ledger.row(event, self.prices, self.sla))
                events.append(event)
            except ValueError:  # not an event of ours: acknowledged with the rest, logged, never retried
                log.error("dropping malformed completion event %s", delivery.entry_id)
        return events, rows, cuts

    async def _cut(self, cuts: dict[str, tuple[str, int]]) -> set[str]:
        """Applies the delivery cuts (entry id -> request id, deliveries); returns the entries to leave pending.
        A cut follows its request's event on the stream, so its row is normally there; one read before it (the
        event's consumer died, and the janitor has yet to take it over) is left for the janitor to offer again."""
        if not cuts:  # most batches: no thread hop, no transaction
            return set()
        recorded, turned = await asyncio.to_thread(ledger.cut, self.engine, [rid for rid, _ in cuts.values()])
        for row in turned:
            self.metrics.cut(row)
        waiting = set()
        for entry_id, (request_id, deliveries) in cuts.items():
            if request_id in recorded:
                continue
            if deliveries < self.streams.max_deliveries:
                waiting.add(entry_id)
            else:
                log.error("dropping the delivery cut of %s: its request has no ledger row", request_id)
        return waiting
