"""The goodput report over a large ledger (200 000 rows, PostgreSQL at DATABASE_URL, else SQLite): its latency
percentiles are computed in the database, equal numpy's linear percentiles (PostgreSQL's percentile_cont) and
need memory that does not grow with the rows."""

from __future__ import annotations

import time
import tracemalloc
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from sqlalchemy import insert

from services.accounting import db, reports
from services.accounting.models import LedgerRow
from tests.accounting.conftest import ledger_row

ROWS = 200_000
BATCH = 20_000
T0 = datetime(2026, 2, 1, tzinfo=UTC)
MONTH = reports.LedgerFilter(start=T0, end=T0 + timedelta(days=28))
GROUPS = [(model, sla_class) for model in ("large", "small") for sla_class in ("interactive", "batch")]
STATUSES = np.array(["ok", "error", "rejected"])
QUANTILES = (50, 95, 99)
# 200 000 rows' two timings alone would take ~13 MB as Python floats in lists; the report may hold a few groups.
MAX_PEAK_BYTES = 2 * 1024 * 1024


def _synthetic(seed: int = 13) -> dict[str, np.ndarray]:
    """Per row: its group, status (90 % ok, 5 % error, 5 % rejected) and timings, rounded to 0.1 ms so that many
    tie; each group's timings have a scale of their own."""
    rng = np.random.default_rng(seed)
    group = rng.integers(0, len(GROUPS), ROWS)
    scale = 0.05 * (1 + group)
    return {"group": group, "status": rng.choice(len(STATUSES), ROWS, p=[0.9, 0.05, 0.05]),
            "ttft_s": np.round(rng.lognormal(0, 0.8, ROWS) * scale, 4),
            "tpot_s": np.round(rng.gamma(2.0, 0.01, ROWS) * scale, 4)}


def _insert(engine, data: dict[str, np.ndarray]) -> None:
    """In batches, as dicts to one executemany each: the list of 200 000 dicts would itself take ~300 MB."""
    template = ledger_row(T0)
    statuses = STATUSES[data["status"]]
    with engine.begin() as connection:
        for lo in range(0, ROWS, BATCH):
            batch = []
            for i in range(lo, min(lo + BATCH, ROWS)):
                model, sla_class = GROUPS[data["group"][i]]
                finished = T0 + timedelta(seconds=12 * i)  # spread over the 28 days
                status = str(statuses[i])
                batch.append(template | {
                    "request_id": f"r{i}", "model": model, "sla_class": sla_class, "status": status,
                    "ttft_s": float(data["ttft_s"][i]), "tpot_s": float(data["tpot_s"][i]),
                    "sla_met": status == "ok" and i % 3 > 0, "enqueued_at": finished, "finished_at": finished})
            connection.execute(insert(LedgerRow), batch)


@pytest.fixture(scope="module")
def large_ledger(new_database):
    """(engine, {(model, sla_class): {"ttft_s": ok tasks' TTFTs, "tpot_s": their TPOTs}})."""
    engine = db.connect(new_database())
    db.migrate(engine)
    data = _synthetic()
    _insert(engine, data)
    ok = data["status"] == 0
    timings = {GROUPS[g]: {name: data[name][ok & (data["group"] == g)] for name in ("ttft_s", "tpot_s")}
               for g in range(len(GROUPS))}
    yield engine, timings
    engine.dispose()


def _percentile_cont(values: np.ndarray, q: float) -> float:
    """PostgreSQL's definition (orderedsetaggs.c): the sorted values' entry at position q * (n - 1), interpolated
    as first + fraction * (second - first) in double precision."""
    ordered = sorted(float(v) for v in values)
    position = q * (len(ordered) - 1)
    first_row = int(position)
    fraction = position - first_row
    if fraction == 0:
        return ordered[first_row]
    return ordered[first_row] + fraction * (ordered[first_row + 1] - ordered[first_row])


def _report(engine) -> dict[tuple[str, str], dict]:
    return {(group["model"], group["sla_class"]): group for group in reports.goodput(engine, MONTH)}


def test_goodput_percentiles_of_a_large_ledger_are_numpys_linear_percentiles_of_the_ok_tasks(large_ledger):
    engine, timings = large_ledger
    report = _report(engine)
    assert sorted(report) == sorted(GROUPS)
    for key, columns in timings.items():
        for name, values in columns.items():
            expected = dict(zip((f"p{p}" for p in QUANTILES), np.percentile(values, QUANTILES), strict=True))
            assert report[key][name] == pytest.approx(expected, rel=1e-12), (key, name)


def test_goodput_percentiles_are_percentile_conts_to_the_last_bit_on_either_backend(large_ledger):
    engine, timings = large_ledger
    report = _report(engine)
    for key, columns in timings.items():
        for name, values in columns.items():
            assert report[key][name] == {f"p{p}": _percentile_cont(values, p / 100) for p in QUANTILES}, (key, name)


def test_goodput_over_a_large_ledger_takes_memory_that_does_not_grow_with_its_rows(large_ledger):
    engine, _ = large_ledger
    _report(engine)  # warm: the pool's connection and SQLAlchemy's compiled-statement cache
    tracemalloc.start()
    try:
        began = time.perf_counter()
        report = reports.goodput(engine, MONTH)
        elapsed = time.perf_counter() - began
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"goodput() on {ROWS} rows ({engine.dialect.name}): {elapsed:.2f} s, peak {peak / 1024:.0f} KiB traced")
    assert sum(group["tasks"] + group["rejected"] for group in report) == ROWS
    assert peak < MAX_PEAK_BYTES
