"""The finance API's queries on the ledger: plain functions of an engine and a filter, SQLAlchemy 2.x selects
that run on PostgreSQL and SQLite alike. Aggregation stays in the database, latency percentiles included
(PostgreSQL's percentile_cont; on SQLite, which has none, a window function picks the values to interpolate), so
a report's memory does not grow with the rows it covers.

Money comes back as `Decimal`; `jsonable` and `csv_chunks` write it as decimal strings (never floats, which
would round a 12-decimal cost) and times as ISO-8601 in UTC."""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal

from sqlalchemy import ColumnElement, Connection, Engine, Integer, case, cast, func, literal_column, or_, select

from services.accounting.models import LedgerRow
from services.tenancy.sla import Attainment, percentiles

TABLE = LedgerRow.__table__
FIELDS = [column.name for column in TABLE.columns]  # the ledger's columns, in JSON and CSV alike
PER_TOKENS = Decimal(1_000_000)
PER_TOKENS_QUANTUM = Decimal("1e-6")  # cost per 1 M tokens, to the micro-dollar
EXPORT_BATCH = 1000
Bucket = Literal["hour", "day"]
GROUP = (LedgerRow.model, LedgerRow.sla_class)  # the goodput report's groups
LATENCIES = (LedgerRow.ttft_s, LedgerRow.tpot_s)
PERCENTILES = (50, 95, 99)  # as `sla.percentiles` reports them: {"p50": .., "p95": .., "p99": ..}
REJECTED = "rejected"  # the status of a task refused for the client's own fault: not counted against the SLA


def utc(value: datetime) -> datetime:
    """Aware, in UTC. Naive times are UTC: SQLite returns finished_at naive (it stores UTC wall-clock time), and a
    query value without an offset is read as UTC."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


@dataclass(frozen=True)
class LedgerFilter:
    """Which rows: each set field narrows; the window is [start, end) on finished_at."""

    tenant: str | None = None
    model: str | None = None
    status: str | None = None
    start: datetime | None = None
    end: datetime | None = None

    def where(self) -> list[ColumnElement[bool]]:
        # SQLite's DateTime binds drop the offset, so a bound is converted to UTC first (as stored)
        clauses = [column == value for column, value in (
            (LedgerRow.tenant, self.tenant), (LedgerRow.model, self.model), (LedgerRow.status, self.status))
            if value is not None]
        if self.start is not None:
            clauses.append(LedgerRow.finished_at >= utc(self.start))
        if self.end is not None:
            clauses.append(LedgerRow.finished_at < utc(self.end))
        return clauses

    @property
    def window_s(self) -> float:
        if self.start is None or self.end is None:
            raise ValueError("the window needs a start and an end")
        return (utc(self.end) - utc(self.start)).total_seconds()


@dataclass(frozen=True)
class Page:
    rows: list[dict[str, Any]]
    has_more: bool
    next_after: int | None


def page(engine: Engine, filters: LedgerFilter, limit: int, after: int | None = None) -> Page:
    """Up to `limit` rows with ids above `after`, in id order (keyset: each page is an index range scan, and
    rows recorded meanwhile neither shift nor repeat earlier ones, as OFFSET would)."""
    statement = select(TABLE).where(*filters.where()).order_by(LedgerRow.id).limit(limit + 1)
    if after is not None:
        statement = statement.where(LedgerRow.id > after)
    with engine.connect() as connection:
        rows = [dict(row) for row in connection.execute(statement).mappings()]
    has_more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, has_more, rows[-1]["id"] if has_more else None)


def iter_rows(engine: Engine, filters: LedgerFilter, batch: int = EXPORT_BATCH) -> Iterator[dict[str, Any]]:
    """Every matching row, in id order: one short query per batch rather than one cursor held open while a
    slow client reads the export (which would pin a connection, and on SQLite a read transaction)."""
    after = None
    while True:
        chunk = page(engine, filters, batch, after)
        yield from chunk.rows
        if not chunk.has_more:
            return
        after = chunk.next_after


def jsonable(value: Any) -> Any:
    if isinstance(value, Decimal):
        return format(value, "f")  # "0.000000000120", not "1.20E-10"
    if isinstance(value, datetime):
        return utc(value).isoformat()
    return value


def plain(row: dict[str, Any]) -> dict[str, Any]:
    return {key: jsonable(value) for key, value in row.items()}


def csv_chunks(rows: Iterable[dict[str, Any]], batch: int = EXPORT_BATCH) -> Iterator[str]:
    """CSV text with a header row, a chunk per `batch` rows (a streamed response's pieces)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(FIELDS)
    for count, row in enumerate(rows, 1):
        writer.writerow([_csv_value(row[field]) for field in FIELDS])
        if count % batch == 0:
            yield _drain(buffer)
    yield _drain(buffer)


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"  # as in the JSON, not Python's True
    return jsonable(value)


def _drain(buffer: io.StringIO) -> str:
    text = buffer.getvalue()
    buffer.seek(0)
    buffer.truncate()
    return text


def cost(engine: Engine, filters: LedgerFilter, group_by: Bucket | None = None) -> list[dict[str, Any]]:
    """Per tenant and model (and time bucket when `group_by` is set): tasks, tokens, list and measured cost,
    and both costs per 1 M output tokens (None without output tokens)."""
    keys = [LedgerRow.tenant, LedgerRow.model]
    if group_by:
        keys.append(_bucket(engine.dialect.name, group_by).label("bucket"))
    statement = select(
        *keys, func.count().label("tasks"), func.sum(LedgerRow.prompt_tokens).label("prompt_tokens"),
        func.sum(LedgerRow.cached_tokens).label("cached_tokens"),
        func.sum(LedgerRow.completion_tokens).label("completion_tokens"),
        func.sum(LedgerRow.draft_tokens).label("draft_tokens"),
        func.sum(LedgerRow.accepted_draft_tokens).label("accepted_draft_tokens"),
        func.sum(LedgerRow.list_cost_usd).label("list_cost_usd"),
        func.sum(LedgerRow.measured_cost_usd).label("measured_cost_usd"),
    ).where(*filters.where()).group_by(*keys).order_by(*keys)
    with engine.connect() as connection:
        groups = [dict(row) for row in connection.execute(statement).mappings()]
    for group in groups:
        if group_by:
            group["bucket"] = _bucket_start(group["bucket"])
        for name in ("list", "measured"):
            group[f"{name}_usd_per_1m_output_tokens"] = per_million(group[f"{name}_cost_usd"],
                                                                     group["completion_tokens"])
    return groups


def per_million(usd: Decimal, tokens: int) -> Decimal | None:
    if not tokens:
        return None
    return (Decimal(usd) * PER_TOKENS / tokens).quantize(PER_TOKENS_QUANTUM)


def _bucket(dialect: str, unit: Bucket) -> ColumnElement:
    """The UTC hour or day a task finished in, by dialect-specific SQL, so that only the groups leave the
    database. The unit is a literal, not a bound parameter: PostgreSQL would see the SELECT's and the GROUP
    BY's `date_trunc($1, ..)` and `date_trunc($2, ..)` as different expressions and refuse the query."""
    if dialect == "postgresql":
        in_utc = func.timezone(literal_column("'UTC'"), LedgerRow.finished_at)
        return func.date_trunc(literal_column(f"'{unit}'"), in_utc)
    if dialect == "sqlite":
        pattern = "%Y-%m-%d %H:00:00" if unit == "hour" else "%Y-%m-%d 00:00:00"
        return func.strftime(literal_column(f"'{pattern}'"), LedgerRow.finished_at)
    raise NotImplementedError(f"time buckets on {dialect}")


def _bucket_start(value: datetime | str) -> datetime:
    return utc(datetime.fromisoformat(value) if isinstance(value, str) else value)


def goodput(engine: Engine, filters: LedgerFilter) -> list[dict[str, Any]]:
    """Per model and SLA class over the filter's window: tasks, met, attainment (met / tasks), goodput (met per
    second of the window), the ok and the rejected tasks, and TTFT and TPOT percentiles of the tasks that finished
    ok. A rejected task (refused for the client's own fault) is counted apart: not in tasks, met, attainment or
    goodput, which measure the service."""
    window_s = filters.window_s
    served = LedgerRow.status != REJECTED
    counts = select(*GROUP, _count(served).label("tasks"), _count(served & LedgerRow.sla_met).label("met"),
                    _count(LedgerRow.status == "ok").label("ok"), _count(~served).label("rejected"),
                    ).where(*filters.where()).group_by(*GROUP).order_by(*GROUP)
    with engine.connect() as connection:
        groups = list(connection.execute(counts).mappings())
        latencies = latency_percentiles(connection, [*filters.where(), LedgerRow.status == "ok"])
    report = []
    for group in groups:
        attained = Attainment(int(group["tasks"]), int(group["met"]), window_s)
        found = latencies.get((group["model"], group["sla_class"]), {})
        report.append({"model": group["model"], "sla_class": group["sla_class"], "tasks": attained.tasks,
                       "met": attained.met, "ok": int(group["ok"]), "rejected": int(group["rejected"]),
                       "attainment": attained.share, "goodput": attained.goodput,
                       **{column.name: found.get(column.name) or percentiles([]) for column in LATENCIES}})
    return report


def _count(condition: ColumnElement[bool]) -> ColumnElement[int]:
    return func.sum(case((condition, 1), else_=0))


def latency_percentiles(connection: Connection, where: list[ColumnElement[bool]]
                        ) -> dict[tuple[str, str], dict[str, dict[str, float]]]:
    """{(model, SLA class): {"ttft_s": {"p50": .., "p95": .., "p99": ..}, "tpot_s": {..}}} of the rows `where`
    selects, as PostgreSQL's percentile_cont defines them (numpy's default "linear" percentiles too): the value at
    position q * (n - 1) of the sorted values, interpolated linearly between its neighbours. Computed in the
    database; only the few values each needs leave it, so memory does not grow with the rows. Groups without
    rows are absent."""
    if connection.dialect.name == "postgresql":
        return _percentile_cont(connection, where)
    return _ranked_percentiles(connection, where)


def _percentile_cont(connection: Connection, where: list[ColumnElement[bool]]
                     ) -> dict[tuple[str, str], dict[str, dict[str, float]]]:
    figures = [func.percentile_cont(p / 100).within_group(column).label(f"{column.name}_p{p}")
               for column in LATENCIES for p in PERCENTILES]
    statement = select(*GROUP, *figures).where(*where).group_by(*GROUP)
    return {(row["model"], row["sla_class"]): {
        column.name: {f"p{p}": row[f"{column.name}_p{p}"] for p in PERCENTILES} for column in LATENCIES}
        for row in connection.execute(statement).mappings()}


def _ranked_percentiles(connection: Connection, where: list[ColumnElement[bool]]
                        ) -> dict[tuple[str, str], dict[str, dict[str, float]]]:
    """SQLite has no percentile function: a window function numbers each group's sorted values (SQLite sorts
    them, spilling to disk past its cache), and only the two values around each percentile's position are
    read, to be interpolated here as percentile_cont does."""
    found: dict[tuple[str, str], dict[str, dict[str, float]]] = defaultdict(dict)
    for column in LATENCIES:
        window = {"partition_by": GROUP, "order_by": column}
        ranked = select(*GROUP, column.label("value"), (func.row_number().over(**window) - 1).label("ordinal"),
                        func.count().over(**window, rows=(None, None)).label("n")).where(*where).subquery()
        neighbours = []
        for p in PERCENTILES:
            below = cast((ranked.c.n - 1) * (p / 100), Integer)  # CAST truncates: the floor of a position >= 0
            neighbours += [ranked.c.ordinal == below, ranked.c.ordinal == below + 1]
        picked: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
        sizes: dict[tuple[str, str], int] = {}
        statement = select(ranked.c.model, ranked.c.sla_class, ranked.c.ordinal, ranked.c.value, ranked.c.n
                           ).where(or_(*neighbours))
        for model, sla_class, ordinal, value, n in connection.execute(statement):
            picked[model, sla_class][ordinal] = value
            sizes[model, sla_class] = n
        for key, values in picked.items():
            found[key][column.name] = {f"p{p}": _interpolate(values, sizes[key], p / 100) for p in PERCENTILES}
    return dict(found)


def _interpolate(sorted_values: dict[int, float], n: int, q: float) -> float:
    """percentile_cont's value at fraction `q` of n sorted values, from the two around its position (PostgreSQL
    computes it as first + fraction * (second - first), in the same float arithmetic)."""
    position = (n - 1) * q
    below = int(position)
    fraction = position - below
    first = sorted_values[below]
    return first if fraction == 0 else first + fraction * (sorted_values[below + 1] - first)
