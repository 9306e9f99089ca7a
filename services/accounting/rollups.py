"""Rollups of the ledger per UTC hour or day, tenant and model (the `ledger_rollups` table), and retention that
deletes raw rows only where rollups hold their figures. Plain functions of an engine; the Celery tasks in
`services.jobs.tasks` call them on a schedule.

Every figure is computed here, in Python, from the bucket's raw rows: money as exact Decimal sums (SQLite's SUM
of a NUMERIC column is a float sum) and latency percentiles by numpy's linear interpolation (the definition of
PostgreSQL's percentile_cont, which `reports.goodput` has the database compute). Rows are read one UTC day at a
time, so memory holds at most one day of latencies. Rejected tasks (refused for the client's own fault) are
counted apart: their tokens and costs are summed, but tasks, sla_met, attainment and goodput leave them out.

Re-rolling is idempotent: a bucket's figures are replaced, never added to, so the scheduler may re-roll recent
buckets as often as it likes and late events (finished in a bucket already rolled) are counted the next time."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Literal

from sqlalchemy import ColumnElement, Connection, Engine, delete, exists, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from services.accounting.models import LedgerRollup, LedgerRow
from services.accounting.reports import REJECTED, utc
from services.tenancy.sla import Attainment, percentiles

Period = Literal["hour", "day"]
SPAN: dict[str, timedelta] = {"hour": timedelta(hours=1), "day": timedelta(days=1)}
DAY = SPAN["day"]
KEY = ("period", "bucket_start", "tenant", "model")
FIGURES = [c.name for c in LedgerRollup.__table__.columns if c.name not in (*KEY, "raw_pruned")]
READ = (LedgerRow.finished_at, LedgerRow.tenant, LedgerRow.model, LedgerRow.status, LedgerRow.prompt_tokens,
        LedgerRow.cached_tokens, LedgerRow.completion_tokens, LedgerRow.draft_tokens, LedgerRow.accepted_draft_tokens,
        LedgerRow.list_cost_usd, LedgerRow.measured_cost_usd, LedgerRow.sla_met, LedgerRow.ttft_s, LedgerRow.tpot_s)


def floor(moment: datetime, period: Period) -> datetime:
    """The start of the UTC hour or day `moment` falls in (a naive moment is UTC, as the ledger stores it)."""
    moment = utc(moment).replace(minute=0, second=0, microsecond=0)
    return moment if period == "hour" else moment.replace(hour=0)


def ceil(moment: datetime, period: Period) -> datetime:
    start = floor(moment, period)
    return start if start == utc(moment) else start + SPAN[period]


@dataclass
class _Group:
    """One (bucket, tenant, model) being summed."""

    tasks: int = 0  # those the SLA counts: every task but the rejected
    ok_tasks: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    list_cost_usd: Decimal = Decimal(0)
    measured_cost_usd: Decimal = Decimal(0)
    sla_met: int = 0
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)

    def add(self, row: Any) -> None:
        """Tokens and costs of every task; a rejected one (refused for the client's own fault) is counted apart
        from the tasks its SLA attainment and goodput count."""
        if row.status == REJECTED:
            self.rejected += 1
        else:
            self.tasks += 1
            self.sla_met += bool(row.sla_met)
        self.prompt_tokens += row.prompt_tokens
        self.cached_tokens += row.cached_tokens
        self.completion_tokens += row.completion_tokens
        self.draft_tokens += row.draft_tokens
        self.accepted_draft_tokens += row.accepted_draft_tokens
        self.list_cost_usd += row.list_cost_usd
        self.measured_cost_usd += row.measured_cost_usd
        if row.status == "ok":  # a failed task's timings say nothing about serving latency
            self.ok_tasks += 1
            self.ttfts.append(row.ttft_s)
            self.tpots.append(row.tpot_s)

    def figures(self, span_s: float) -> dict[str, Any]:
        attained = Attainment(self.tasks, self.sla_met, span_s)
        return {
            "tasks": self.tasks, "ok_tasks": self.ok_tasks, "rejected": self.rejected,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "draft_tokens": self.draft_tokens, "accepted_draft_tokens": self.accepted_draft_tokens,
            "list_cost_usd": self.list_cost_usd, "measured_cost_usd": self.measured_cost_usd,
            "sla_met": self.sla_met, "attainment": attained.share, "goodput": attained.goodput,
            **{f"ttft_{p}_s": value for p, value in percentiles(self.ttfts).items()},
            **{f"tpot_{p}_s": value for p, value in percentiles(self.tpots).items()},
        }


def roll_up(engine: Engine, period: Period, start: datetime, end: datetime) -> int:
    """Recomputes every `period` bucket overlapping [start, end) from the raw rows and writes its figures per
    tenant and model, replacing earlier ones (buckets whose raw rows retention pruned keep theirs). Goodput is
    per second of the whole bucket, so the current bucket's grows as it fills. Returns the rollup rows written."""
    if period not in SPAN:
        raise ValueError(f"period must be 'hour' or 'day', not {period!r}")
    return sum(_roll_day(engine, period, lo, hi) for lo, hi in _days(floor(start, period), ceil(end, period)))


def roll_up_recent(engine: Engine, hours: float, now: datetime | None = None) -> int:
    """The hour and day buckets of the last `hours`, the current ones included."""
    now = utc(now or datetime.now(UTC))
    start = now - timedelta(hours=hours)
    return roll_up(engine, "hour", start, now) + roll_up(engine, "day", start, now)


def prune(engine: Engine, older_than: datetime) -> int:
    """Deletes raw rows that finished before `older_than`, in whole UTC days only (a partly pruned day re-rolled
    later would lose the pruned part's figures), and of those only the rows whose day, tenant and model have a
    daily rollup: figures are never lost. The pruned days' rollups are marked `raw_pruned`. Returns rows deleted."""
    cut = floor(older_than, "day")
    first = _first_finished(engine, cut)
    if first is None:
        return 0
    return sum(_prune_day(engine, day) for day, _ in _days(floor(first, "day"), cut))


def roll_up_and_prune(engine: Engine, older_than: datetime) -> int:
    """Retention: re-rolls the whole days before `older_than` that still hold raw rows (rows that came late, or
    days no scheduled rollup covered, such as those recorded before rollups existed), then prunes them."""
    cut = floor(older_than, "day")
    first = _first_finished(engine, cut)
    if first is None:
        return 0
    roll_up(engine, "hour", first, cut)
    roll_up(engine, "day", first, cut)
    return prune(engine, cut)


def _days(lo: datetime, hi: datetime) -> Iterator[tuple[datetime, datetime]]:
    """[lo, hi) cut at UTC midnights: no hour or day bucket straddles one."""
    while lo < hi:
        cut = min(floor(lo, "day") + DAY, hi)
        yield lo, cut
        lo = cut


def _roll_day(engine: Engine, period: Period, lo: datetime, hi: datetime) -> int:
    groups: dict[tuple[datetime, str, str], _Group] = defaultdict(_Group)
    # Read, then write in a transaction of its own: SQLite cannot upgrade a read transaction to a write once
    # another connection (the ledger consumer) has committed since, and a write first waits on busy_timeout.
    with engine.connect() as connection:
        for row in connection.execute(select(*READ).where(LedgerRow.finished_at >= lo, LedgerRow.finished_at < hi)):
            groups[floor(row.finished_at, period), row.tenant, row.model].add(row)
        vanished = _rolled_keys(connection, period, lo, hi) - groups.keys()
    rolled_at = datetime.now(UTC)
    rows = [{"period": period, "bucket_start": bucket, "tenant": tenant, "model": model,
             **group.figures(SPAN[period].total_seconds()), "rolled_at": rolled_at}
            for (bucket, tenant, model), group in groups.items()]
    with engine.begin() as connection:
        for bucket, tenant, model in vanished:  # their raw rows were deleted (not by retention): so go their figures
            connection.execute(delete(LedgerRollup).where(
                LedgerRollup.period == period, LedgerRollup.bucket_start == bucket, LedgerRollup.tenant == tenant,
                LedgerRollup.model == model, LedgerRollup.raw_pruned.is_(False)))
        if rows:
            connection.execute(_upsert(engine.dialect.name), rows)
    return len(rows)


def _rolled_keys(connection: Connection, period: Period, lo: datetime, hi: datetime) -> set[tuple[datetime, str, str]]:
    keys = select(LedgerRollup.bucket_start, LedgerRollup.tenant, LedgerRollup.model).where(
        LedgerRollup.period == period, LedgerRollup.bucket_start >= lo, LedgerRollup.bucket_start < hi,
        LedgerRollup.raw_pruned.is_(False))
    return {(utc(bucket), tenant, model) for bucket, tenant, model in connection.execute(keys)}


def _upsert(dialect_name: str):
    """INSERT .. ON CONFLICT (key) DO UPDATE, in PostgreSQL's or SQLite's dialect (both spell it alike); a rollup
    whose raw rows are gone keeps its figures."""
    insert = (postgresql if dialect_name == "postgresql" else sqlite).insert(LedgerRollup)
    figures = {name: insert.excluded[name] for name in FIGURES}
    return insert.on_conflict_do_update(index_elements=list(KEY), set_=figures,
                                        where=LedgerRollup.raw_pruned.is_(False))


def _first_finished(engine: Engine, before: datetime) -> datetime | None:
    with engine.connect() as connection:
        first = connection.execute(select(func.min(LedgerRow.finished_at)).where(LedgerRow.finished_at < before))
        value = first.scalar()
    return None if value is None else utc(value)


def _prune_day(engine: Engine, day: datetime) -> int:
    """One day per transaction: on SQLite a long delete would hold the write lock past the consumer's timeout."""
    with engine.begin() as connection:
        deleted = connection.execute(delete(LedgerRow).where(
            _within(LedgerRow.finished_at, day), _rolled_up(day, LedgerRow.tenant, LedgerRow.model))).rowcount
        connection.execute(update(LedgerRollup).where(
            _within(LedgerRollup.bucket_start, day), LedgerRollup.raw_pruned.is_(False),
            _rolled_up(day, LedgerRollup.tenant, LedgerRollup.model)).values(raw_pruned=True))
    return deleted


def _within(column: ColumnElement, day: datetime) -> ColumnElement[bool]:
    return (column >= day) & (column < day + DAY)


def _rolled_up(day: datetime, tenant: ColumnElement, model: ColumnElement) -> ColumnElement[bool]:
    """Whether `day` has a daily rollup for the tenant and model of the row the caller's statement is at."""
    daily = LedgerRollup.__table__.alias("daily")
    return exists().where(daily.c.period == "day", daily.c.bucket_start == day, daily.c.tenant == tenant,
                          daily.c.model == model)
