"""The ledger on a real SQL database (PostgreSQL at DATABASE_URL, else SQLite) fed from a real Redis events
stream: one row per task, replays add nothing, a consumer killed mid-batch loses nothing."""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, select

from services.accounting import ledger
from services.accounting.consumer import ACCOUNTING_GROUP, LedgerConsumer, no_settlement
from services.accounting.metrics import LedgerMetrics
from services.accounting.models import Base, LedgerRow
from services.base import protocol as p
from services.base import streams
from services.base.redis_client import EmbeddedRedis, connect
from services.base.replies import end_for_client
from services.base.settings import StreamSettings
from services.tenancy.prices import PriceTable
from services.tenancy.sla import SlaPolicy

PRICES, SLA = PriceTable.load(), SlaPolicy.load()


def _event(status: p.TaskStatus = "ok", cache: str | None = None, **usage) -> p.CompletionEvent:
    routing = p.RoutingDecision(model="tokenfleet-large", reason="named by the request", decided_at=0.0,
                                worker="w1", worker_reason="prefix 64 cached tokens", cache=cache)
    return p.CompletionEvent(
        request_id=uuid.uuid4().hex, model="tokenfleet-large", worker_id="w1", worker_class="cpu", tier="large",
        api_key_name="acme", api_key_id="k" * 64, finish_reasons=["stop"], routing=routing, status=status,
        usage=p.Usage(**{"prompt_tokens": 100, "completion_tokens": 20, "cached_tokens": 64, **usage}),
        timing=p.Timing(queue_s=0.01, ttft_s=0.2, tpot_s=0.02, e2e_s=0.6, engine_s=0.55, engine_step_s=0.36),
        enqueued_at=1_000.0, finished_at=1_000.6)


def _rows(engine) -> list[LedgerRow]:
    with engine.connect() as connection:
        return list(connection.execute(select(LedgerRow).order_by(LedgerRow.id)))


def test_a_row_holds_the_tasks_tokens_costs_timings_and_decisions(ledger_engine):
    event = _event()
    ledger.record(ledger_engine, [ledger.row(event, PRICES, SLA)])
    [row] = _rows(ledger_engine)
    assert (row.request_id, row.tenant, row.model, row.tier, row.worker_id, row.status) == (
        event.request_id, "acme", "tokenfleet-large", "large", "w1", "ok")
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.cache_result) == (100, 64, 20, "prefix")
    price = PRICES.price("tokenfleet-large")
    assert row.list_cost_usd == Decimal(repr((36 * price.input + 64 * price.cached_input + 20 * price.output) / 1e6)
                                        ).quantize(Decimal("1e-12"))
    assert row.measured_cost_usd == Decimal(repr(0.36 * PRICES.usd_per_hour["cpu"] / 3600)).quantize(Decimal("1e-12"))
    assert row.gpu_seconds == 0.36 and row.sla_class == "interactive" and row.sla_met
    assert row.routing_reason == "named by the request; prefix 64 cached tokens"


def test_a_row_holds_the_speculative_guesses_scored_and_kept(ledger_engine):
    ledger.record(ledger_engine, [ledger.row(_event(draft_tokens=30, accepted_draft_tokens=12), PRICES, SLA),
                                  ledger.row(_event(), PRICES, SLA)])
    assert [(r.draft_tokens, r.accepted_draft_tokens) for r in _rows(ledger_engine)] == [(30, 12), (0, 0)]


def test_the_migrated_schema_is_the_one_the_models_describe(ledger_engine):
    with ledger_engine.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert differences == []


def test_a_replayed_event_adds_no_second_row(ledger_engine):
    rows = [ledger.row(_event(), PRICES, SLA) for _ in range(3)]
    assert len(ledger.record(ledger_engine, rows[:2])) == 2
    assert ledger.record(ledger_engine, rows) == [rows[2]["request_id"]]
    assert len(_rows(ledger_engine)) == 3


def test_failed_tasks_are_recorded_with_their_status_and_never_meet_an_sla(ledger_engine):
    events = [_event(status) for status in ("error", "cancelled", "dead-lettered")]
    ledger.record(ledger_engine, [ledger.row(e, PRICES, SLA) for e in events])
    assert [(r.status, r.sla_met) for r in _rows(ledger_engine)] == [
        ("error", False), ("cancelled", False), ("dead-lettered", False)]


def test_a_response_cache_hit_is_priced_at_the_cached_input_price_with_no_measured_cost(ledger_engine):
    event = _event(cache="semantic", cached_tokens=100)
    event.worker_class, event.timing.engine_step_s = None, 0.0
    ledger.record(ledger_engine, [ledger.row(event, PRICES, SLA)])
    [row] = _rows(ledger_engine)
    expected = Decimal(repr(120 * PRICES.price("tokenfleet-large").cached_input / 1e6)).quantize(Decimal("1e-12"))
    assert (row.cache_result, row.list_cost_usd, row.measured_cost_usd) == ("semantic", expected, Decimal(0))


def _consumer_run(ledger_engine, entries: list[p.Message], dead_reader_takes: int = 0, settle=no_settlement,
                  replay: bool = False, metrics: LedgerMetrics | None = None) -> int:
    """`entries` on a fresh events stream; a consumer that dies after reading the first `dead_reader_takes`, then
    a survivor reading the rest and, in two janitor ticks, taking over the dead one's (`replay`: the second tick
    writes the first one's batch again, as if the survivor had crashed after its commit). Returns what is left
    pending."""
    settings = StreamSettings(claim_idle_ms=0)

    async def scenario():
        embedded = EmbeddedRedis()
        redis = connect(embedded.url)
        try:
            await streams.ensure_group(redis, p.EVENTS_STREAM, ACCOUNTING_GROUP)
            for entry in entries:
                await redis.xadd(p.EVENTS_STREAM, entry.encode())
            if dead_reader_takes:
                await streams.read_new(redis, p.EVENTS_STREAM, ACCOUNTING_GROUP, "a", dead_reader_takes, None)
            survivor = LedgerConsumer(redis, ledger_engine, PRICES, SLA, "b", settings, settle, metrics)
            await survivor.write(await streams.read_new(redis, p.EVENTS_STREAM, ACCOUNTING_GROUP, "b", 10, None))
            claimer = streams.StaleClaimer(redis, p.EVENTS_STREAM, ACCOUNTING_GROUP, "b", settings)
            claimed = await claimer.claim(10)
            await survivor.write(claimed)
            await survivor.write(claimed if replay else await claimer.claim(10))
            return (await redis.xpending(p.EVENTS_STREAM, ACCOUNTING_GROUP))["pending"]
        finally:
            await redis.aclose()
            embedded.close()

    return asyncio.run(scenario())


def test_a_consumer_killed_before_its_commit_loses_no_event_and_a_replay_duplicates_none(ledger_engine):
    events = [_event() for _ in range(5)]
    settled = []

    async def settle(request_id: str, usd: float) -> None:
        settled.append(request_id)

    # consumer "a" reads the batch and dies before writing it; the survivor's janitor takes it over, and its
    # second tick replays the batch as if the survivor had crashed after its commit, before acknowledging
    pending = _consumer_run(ledger_engine, events, dead_reader_takes=5, settle=settle, replay=True)
    with ledger_engine.connect() as connection:
        count = connection.execute(select(func.count()).select_from(LedgerRow)).scalar_one()
    assert count == 5 and pending == 0
    assert sorted(set(settled)) == sorted(e.request_id for e in events)  # every task settled, replays harmless


def test_a_row_the_database_refuses_is_dead_lettered_and_the_others_are_recorded(ledger_engine):
    if ledger_engine.dialect.name != "postgresql":
        pytest.skip("SQLite does not enforce column lengths; run with DATABASE_URL=postgresql://… to check this")
    refused = _event()
    refused.api_key_name = "x" * 200  # longer than the tenant column
    events = [_event(), refused, _event()]

    async def scenario():
        embedded = EmbeddedRedis()
        redis = connect(embedded.url)
        try:
            for event in events:
                await redis.xadd(p.EVENTS_STREAM, event.encode())
            await streams.ensure_group(redis, p.EVENTS_STREAM, ACCOUNTING_GROUP)
            consumer = LedgerConsumer(redis, ledger_engine, PRICES, SLA, "a", StreamSettings())
            await consumer.write(await streams.read_new(redis, p.EVENTS_STREAM, ACCOUNTING_GROUP, "a", 10, None))
            letters = [p.decode(p.DeadLetter, f) for _, f in await redis.xrange(p.DEAD_LETTER_STREAM)]
            return letters, (await redis.xpending(p.EVENTS_STREAM, ACCOUNTING_GROUP))["pending"]
        finally:
            await redis.aclose()
            embedded.close()

    letters, pending = asyncio.run(scenario())
    assert sorted(r.request_id for r in _rows(ledger_engine)) == sorted([events[0].request_id, events[2].request_id])
    assert [letter.event.request_id for letter in letters] == [refused.request_id] and pending == 0


def _list_cost(event: p.CompletionEvent, completion_tokens: int) -> Decimal:
    usage = event.usage
    return Decimal(repr(PRICES.list_cost(event.model, usage.prompt_tokens, usage.cached_tokens, completion_tokens))
                   ).quantize(Decimal("1e-12"))


def test_a_delivery_cut_bills_the_tokens_delivered_and_turns_a_finished_tasks_row_cancelled(ledger_engine):
    finished, other, metrics, settled = _event(), _event(), LedgerMetrics(), {}

    async def settle(request_id: str, usd: float) -> None:
        settled[request_id] = usd

    pending = _consumer_run(ledger_engine, [finished, other, p.DeliveryCut(request_id=finished.request_id,
                                                                            delivered_tokens=5)],
                            settle=settle, metrics=metrics)
    rows = {r.request_id: r for r in _rows(ledger_engine)}
    assert (rows[finished.request_id].status, rows[finished.request_id].sla_met) == ("cancelled", False)
    assert rows[finished.request_id].completion_tokens == 5
    assert rows[finished.request_id].list_cost_usd == _list_cost(finished, 5)
    assert settled[finished.request_id] == float(_list_cost(finished, 5))  # the budget charged again: the lower cost
    assert (rows[other.request_id].status, rows[other.request_id].completion_tokens) == ("ok", 20)
    assert pending == 0
    assert metrics.registry.get_sample_value("tokenfleet:delivery_cuts_total", {
        "model": "tokenfleet-large", "sla_class": "interactive", "sla_met": "true"}) == 1


def test_a_delivery_cut_of_every_token_leaves_the_row_ok(ledger_engine):
    finished = _event()
    _consumer_run(ledger_engine, [finished, p.DeliveryCut(request_id=finished.request_id, delivered_tokens=20)])
    assert [(r.status, r.completion_tokens) for r in _rows(ledger_engine)] == [("ok", 20)]


def test_a_delivery_cut_leaves_a_failed_tasks_status_as_it_was_and_bills_what_was_delivered(ledger_engine):
    failed = _event("error")
    _consumer_run(ledger_engine, [failed, p.DeliveryCut(request_id=failed.request_id, delivered_tokens=3)])
    assert [(r.status, r.completion_tokens) for r in _rows(ledger_engine)] == [("error", 3)]


def test_a_gateways_count_written_before_the_workers_event_bills_the_row_when_it_comes(ledger_engine):
    """The gateway ended the response short while the request still ran: its cut finds no row, and the worker's
    event, read later, is billed what the client got."""
    late = _event("cancelled")

    async def scenario():
        embedded = EmbeddedRedis()
        redis = connect(embedded.url)
        settings = StreamSettings()
        try:
            await streams.ensure_group(redis, p.EVENTS_STREAM, ACCOUNTING_GROUP)
            consumer = LedgerConsumer(redis, ledger_engine, PRICES, SLA, "b", settings)
            error = p.ErrorBody(message="the client left", code="cancelled", status=499)
            await end_for_client(redis, late.request_id, error, 7, settings)
            await consumer.write(await streams.read_new(redis, p.EVENTS_STREAM, ACCOUNTING_GROUP, "b", 10, None))
            assert _rows(ledger_engine) == []
            await redis.xadd(p.EVENTS_STREAM, late.encode())
            await consumer.write(await streams.read_new(redis, p.EVENTS_STREAM, ACCOUNTING_GROUP, "b", 10, None))
            return (await redis.xpending(p.EVENTS_STREAM, ACCOUNTING_GROUP))["pending"]
        finally:
            await redis.aclose()
            embedded.close()

    assert asyncio.run(scenario()) == 0
    [row] = _rows(ledger_engine)
    assert (row.request_id, row.status, row.completion_tokens) == (late.request_id, "cancelled", 7)
    assert row.list_cost_usd == _list_cost(late, 7)
