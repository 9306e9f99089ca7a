"""Completion events to ledger rows, and writing them once: a replayed event (the consumer crashed after the
commit, before acknowledging) finds its request id taken and adds nothing."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from sqlalchemy import Engine, select, update
from sqlalchemy.dialects import postgresql, sqlite

from services import protocol as p
from services.accounting.models import LedgerRow
from services.accounting.prices import PriceTable
from services.accounting.sla import SlaPolicy

ANONYMOUS = "anonymous"
RESPONSE_CACHE_HITS = ("exact", "semantic")


def cache_result(event: p.CompletionEvent) -> str:
    cached = event.routing.cache if event.routing else None
    if cached in RESPONSE_CACHE_HITS:
        return cached
    return "prefix" if event.usage.cached_tokens else "none"


def row(event: p.CompletionEvent, prices: PriceTable, sla: SlaPolicy) -> dict:
    """The ledger row of one task, its costs and SLA verdict computed here, once, from the event."""
    usage, timing, routing = event.usage, event.timing, event.routing
    cache = cache_result(event)
    sla_class = sla.of(event.sla_class)
    reason = f"{routing.reason}; {routing.worker_reason}" if routing and routing.worker_reason else (
        routing.reason if routing else None)
    list_cost = prices.list_cost(event.model, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                                 response_cache_hit=cache in RESPONSE_CACHE_HITS)
    measured = prices.measured_cost(event.worker_class or "", timing.engine_step_s)
    finished = event.finished_at
    return {
        "request_id": event.request_id, "tenant": event.api_key_name or ANONYMOUS, "api_key_id": event.api_key_id,
        "model": event.model, "tier": event.tier, "worker_id": event.worker_id or None,
        "worker_class": event.worker_class, "routing_reason": reason[:256] if reason else None,
        "cache_result": cache, "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
        "completion_tokens": usage.completion_tokens, "draft_tokens": usage.draft_tokens,
        "accepted_draft_tokens": usage.accepted_draft_tokens, "queue_s": timing.queue_s, "ttft_s": timing.ttft_s,
        "tpot_s": timing.tpot_s, "e2e_s": timing.e2e_s, "gpu_seconds": timing.engine_step_s,
        "list_cost_usd": _money(list_cost), "measured_cost_usd": _money(measured), "sla_class": sla_class.name,
        "sla_met": sla_class.met(timing.ttft_s, timing.tpot_s, timing.e2e_s, ok=event.status == "ok"),
        "status": event.status, "finished_at": _utc(finished),
        "enqueued_at": _utc(event.enqueued_at if event.enqueued_at is not None else finished - timing.e2e_s),
    }


def record(engine: Engine, rows: list[dict]) -> list[str]:
    """Inserts the rows whose request id is new, in one transaction; returns their request ids."""
    if not rows:
        return []
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    statement = (dialect.insert(LedgerRow).on_conflict_do_nothing(index_elements=["request_id"])
                 .returning(LedgerRow.request_id))
    with engine.begin() as connection:
        return list(connection.execute(statement, rows).scalars())


def cut(engine: Engine, request_ids: list[str]) -> tuple[set[str], list[dict]]:
    """Rows whose client did not get the response whole (`p.DeliveryCut`) say `cancelled`, and missed their SLA.
    Returns the request ids that have a row (the others' events are not recorded yet), and the rows turned from
    ok (model, SLA class, and whether they had met it) for the counters."""
    if not request_ids:
        return set(), []
    ours = LedgerRow.request_id.in_(request_ids)
    with engine.begin() as connection:
        was_ok = [row._asdict() for row in connection.execute(
            select(LedgerRow.model, LedgerRow.sla_class, LedgerRow.sla_met).where(ours, LedgerRow.status == "ok")
            .with_for_update())]
        connection.execute(update(LedgerRow).where(ours, LedgerRow.status == "ok").values(status="cancelled",
                                                                                          sla_met=False))
        return set(connection.execute(select(LedgerRow.request_id).where(ours)).scalars()), was_ok


def _money(usd: float) -> Decimal:
    return Decimal(repr(usd)).quantize(Decimal("1e-12"))


def _utc(epoch_s: float) -> datetime:
    return datetime.fromtimestamp(epoch_s, UTC)
