"""Completion events to ledger rows, and writing them once: a replayed event (the consumer crashed after the
commit, before acknowledging) finds its request id taken and adds nothing. A row bills the completion tokens
its client got: a gateway that ended a response short says how many (`p.delivered_key`, `p.DeliveryCut`), before
or after the worker's event, and the row keeps the lesser count."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from sqlalchemy import Engine, select, update
from sqlalchemy.dialects import postgresql, sqlite

from services.accounting.models import LedgerRow
from services.base import protocol as p
from services.tenancy.prices import PriceTable
from services.tenancy.sla import SlaPolicy

ANONYMOUS = "anonymous"
RESPONSE_CACHE_HITS = ("exact", "semantic")


def cache_result(event: p.CompletionEvent) -> str:
    cached = event.routing.cache if event.routing else None
    if cached in RESPONSE_CACHE_HITS:
        return cached
    return "prefix" if event.usage.cached_tokens else "none"


def as_delivered(event: p.CompletionEvent, delivered_tokens: int | None) -> p.CompletionEvent:
    """The event as its client got it: no more completion tokens than were delivered (None: its gateway ended
    nothing short, and the client got what the event says), and `cancelled` rather than `ok` when that was
    fewer."""
    if delivered_tokens is None or delivered_tokens >= event.usage.completion_tokens:
        return event
    usage = event.usage.model_copy(update={"completion_tokens": delivered_tokens})
    return event.model_copy(update={"usage": usage, "status": "cancelled" if event.status == "ok" else event.status})


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


@dataclass(frozen=True)
class CutRow:
    """A row a delivery cut changed: its new list cost (the budget settles again with it), and whether it had
    counted as ok (its model, SLA class and verdict, for the counters)."""

    request_id: str
    list_cost_usd: Decimal
    was_ok: dict | None


def cut(engine: Engine, cuts: dict[str, int], prices: PriceTable) -> list[CutRow]:
    """Rows whose client did not get the response whole (`p.DeliveryCut`: request id -> tokens it got) bill what
    was delivered, and say `cancelled` (missing their SLA) where they said ok. Returns the rows it changed; a
    request with no row yet is billed from `p.delivered_key` when its event comes."""
    if not cuts:
        return []
    columns = (LedgerRow.request_id, LedgerRow.model, LedgerRow.prompt_tokens, LedgerRow.cached_tokens,
               LedgerRow.completion_tokens, LedgerRow.cache_result, LedgerRow.status, LedgerRow.sla_class,
               LedgerRow.sla_met)
    changed = []
    with engine.begin() as connection:
        for held in connection.execute(select(*columns).where(LedgerRow.request_id.in_(list(cuts)))
                                       .with_for_update()).all():
            delivered = cuts[held.request_id]
            if delivered >= held.completion_tokens:
                continue  # the client got all of it
            list_cost = _money(prices.list_cost(held.model, held.prompt_tokens, held.cached_tokens, delivered,
                                                response_cache_hit=held.cache_result in RESPONSE_CACHE_HITS))
            values = {"completion_tokens": delivered, "list_cost_usd": list_cost}
            if held.status == "ok":
                values.update(status="cancelled", sla_met=False)
            connection.execute(update(LedgerRow).where(LedgerRow.request_id == held.request_id).values(**values))
            was_ok = ({"model": held.model, "sla_class": held.sla_class, "sla_met": held.sla_met}
                      if held.status == "ok" else None)
            changed.append(CutRow(held.request_id, list_cost, was_ok))
    return changed


def _money(usd: float) -> Decimal:
    return Decimal(repr(usd)).quantize(Decimal("1e-12"))


def _utc(epoch_s: float) -> datetime:
    return datetime.fromtimestamp(epoch_s, UTC)
