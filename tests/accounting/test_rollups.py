"""Ledger rollups and retention on a real SQL database (PostgreSQL at DATABASE_URL, else SQLite), and the Celery
jobs that run them, through a real worker with embedded beat on a real Redis."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import redis
from alembic import command
from alembic.config import Config
from sqlalchemy import delete, func, insert, select

from services.accounting import db, ledger, rollups
from services.accounting.models import LedgerRollup, LedgerRow
from services.accounting.reports import utc
from services.base.settings import AccountingSettings
from services.jobs.tasks import APPLY_RETENTION, QUEUES, ROLLUP_RECENT, broker_url, celery_app
from tests.accounting.conftest import ledger_row as _row

HOUR = datetime(2026, 3, 10, 14, tzinfo=UTC)
DAY = datetime(2026, 3, 10, tzinfo=UTC)
ROOT = Path(__file__).resolve().parents[2]


def _rollups(engine, period: str | None = None) -> dict[tuple, dict]:
    statement = select(LedgerRollup.__table__)
    if period:
        statement = statement.where(LedgerRollup.period == period)
    with engine.connect() as connection:
        rows = [dict(row) for row in connection.execute(statement).mappings()]
    return {(r["period"], utc(r["bucket_start"]), r["tenant"], r["model"]): r for r in rows}


def _raw_count(engine) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(LedgerRow)).scalar()


def _crafted(engine) -> None:
    """acme/m1 in HOUR: four ok tasks (three meet the SLA) and a failed one; one more in the next hour; beta/m1 once."""
    at = lambda minute: HOUR + timedelta(minutes=minute)
    ledger.record(engine, [
        _row(at(5), ttft=0.1, tpot=0.01, tokens=(100, 10, 1), costs=("0.000123456789", "0.000000000001"),
             drafts=(8, 5)),
        _row(at(10), ttft=0.4, tpot=0.04, tokens=(200, 20, 2), costs=("0.000200000000", "0.000000000002"), met=False,
             drafts=(4, 1)),
        _row(at(15), ttft=0.2, tpot=0.02, tokens=(300, 30, 3), costs=("0.000300000000", "0.000000000003")),
        _row(at(20), ttft=0.3, tpot=0.03, tokens=(400, 40, 4), costs=("0.000400000000", "0.000000000004")),
        _row(at(25), status="error", ttft=9.0, tpot=9.0, tokens=(500, 0, 0), costs=("0.000500000000", "0")),
        _row(at(70), ttft=0.5, tpot=0.05, tokens=(600, 60, 6), costs=("0.000600000000", "0.000000000006")),
        _row(at(30), tenant="beta", tokens=(7, 0, 7), costs=("0.000000000007", "0")),
    ])


def test_rollup_figures_are_the_sums_attainment_goodput_and_percentiles_of_the_raw_rows(ledger_engine):
    _crafted(ledger_engine)
    assert rollups.roll_up(ledger_engine, "hour", HOUR, HOUR + timedelta(hours=2)) == 3
    assert rollups.roll_up(ledger_engine, "day", HOUR, HOUR) == 2  # an empty range still covers its day
    hours, days = _rollups(ledger_engine, "hour"), _rollups(ledger_engine, "day")
    assert set(hours) == {("hour", HOUR, "acme", "m1"), ("hour", HOUR + timedelta(hours=1), "acme", "m1"),
                          ("hour", HOUR, "beta", "m1")}
    acme = hours["hour", HOUR, "acme", "m1"]
    assert (acme["tasks"], acme["ok_tasks"], acme["sla_met"]) == (5, 4, 3)
    assert (acme["prompt_tokens"], acme["cached_tokens"], acme["completion_tokens"]) == (1500, 100, 10)
    assert (acme["draft_tokens"], acme["accepted_draft_tokens"]) == (12, 6)
    assert acme["list_cost_usd"] == Decimal("0.001523456789")  # exact, on SQLite too
    assert acme["measured_cost_usd"] == Decimal("0.000000000010")
    assert acme["attainment"] == pytest.approx(3 / 5) and acme["goodput"] == pytest.approx(3 / 3600)
    # the ok tasks' TTFTs are 0.1 0.2 0.3 0.4 (the failed task's 9.0 is left out): linear interpolation at rank
    # p/100 * 3 gives p50 = 0.25, p95 = 0.3 + 0.85 * 0.1, p99 = 0.3 + 0.97 * 0.1
    ttft = [acme[f"ttft_p{p}_s"] for p in (50, 95, 99)]
    tpot = [acme[f"tpot_p{p}_s"] for p in (50, 95, 99)]
    assert ttft == pytest.approx([0.25, 0.385, 0.397]) and tpot == pytest.approx([0.025, 0.0385, 0.0397])
    assert hours["hour", HOUR, "beta", "m1"]["list_cost_usd"] == Decimal("0.000000000007")

    day = days["day", DAY, "acme", "m1"]
    assert (day["tasks"], day["ok_tasks"], day["sla_met"], day["prompt_tokens"]) == (6, 5, 4, 2100)
    assert day["list_cost_usd"] == Decimal("0.002123456789")
    assert day["attainment"] == pytest.approx(4 / 6) and day["goodput"] == pytest.approx(4 / 86400)
    assert day["ttft_p50_s"] == pytest.approx(0.3) and not day["raw_pruned"]


def test_a_bucket_with_no_ok_task_has_no_percentiles(ledger_engine):
    ledger.record(ledger_engine, [_row(HOUR, status="cancelled")])
    rollups.roll_up(ledger_engine, "hour", HOUR, HOUR + timedelta(hours=1))
    [only] = _rollups(ledger_engine).values()
    assert (only["tasks"], only["ok_tasks"], only["sla_met"], only["attainment"], only["goodput"]) == (1, 0, 0, 0, 0)
    assert only["ttft_p50_s"] is None and only["tpot_p99_s"] is None


def test_rejected_tasks_are_counted_apart_leaving_attainment_goodput_and_percentiles_as_they_were(ledger_engine):
    _crafted(ledger_engine)
    rollups.roll_up(ledger_engine, "hour", HOUR, HOUR + timedelta(hours=2))
    rollups.roll_up(ledger_engine, "day", HOUR, HOUR)
    before = _figures(ledger_engine)
    # refused for the client's own fault: instant, so their timings would flatter the percentiles
    ledger.record(ledger_engine, [_row(HOUR + timedelta(minutes=m), status="rejected", ttft=0.0, tpot=0.0,
                                       tokens=(0, 0, 0), costs=("0", "0")) for m in (1, 2)])
    rollups.roll_up(ledger_engine, "hour", HOUR, HOUR + timedelta(hours=2))
    rollups.roll_up(ledger_engine, "day", HOUR, HOUR)
    after = _figures(ledger_engine)
    assert {key: row["rejected"] for key, row in before.items()} == dict.fromkeys(before, 0)
    assert {key: row["rejected"] for key, row in after.items()} == {
        ("hour", HOUR, "acme", "m1"): 2, ("hour", HOUR + timedelta(hours=1), "acme", "m1"): 0,
        ("hour", HOUR, "beta", "m1"): 0, ("day", DAY, "acme", "m1"): 2, ("day", DAY, "beta", "m1"): 0}
    assert {key: row | {"rejected": 0} for key, row in after.items()} == before


def test_a_rejected_tasks_tokens_and_costs_are_summed_as_the_cost_report_sums_them(ledger_engine):
    ledger.record(ledger_engine, [_row(HOUR), _row(HOUR, status="rejected", tokens=(9000, 0, 0),
                                                   costs=("0.009", "0"))])
    rollups.roll_up(ledger_engine, "hour", HOUR, HOUR + timedelta(hours=1))
    [only] = _rollups(ledger_engine).values()
    assert (only["tasks"], only["rejected"], only["prompt_tokens"], only["list_cost_usd"]) == (
        1, 1, 9100, Decimal("0.010"))


def test_a_bucket_of_rejected_tasks_alone_has_no_tasks_attainment_or_percentiles(ledger_engine):
    ledger.record(ledger_engine, [_row(HOUR, status="rejected")])
    rollups.roll_up(ledger_engine, "hour", HOUR, HOUR + timedelta(hours=1))
    [only] = _rollups(ledger_engine).values()
    assert (only["tasks"], only["rejected"], only["sla_met"], only["attainment"], only["goodput"]) == (0, 1, 0, 0, 0)
    assert only["ttft_p50_s"] is None


def test_rollups_written_before_migration_0004_count_no_rejected_tasks(new_database):
    engine = db.connect(new_database())
    config = Config()
    config.set_main_option("script_location", str(db.MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0003")
        figures = {name: 0 for name in rollups.FIGURES if name != "rejected"} | {"rolled_at": DAY}
        connection.execute(insert(LedgerRollup).values(period="day", bucket_start=DAY, tenant="acme", model="m1",
                                                       **figures))
    db.migrate(engine)
    assert [row["rejected"] for row in _rollups(engine).values()] == [0]
    engine.dispose()


def _figures(engine) -> dict[tuple, dict]:
    return {key: {k: v for k, v in row.items() if k != "rolled_at"} for key, row in _rollups(engine).items()}


def test_re_rolling_is_idempotent_and_counts_late_rows(ledger_engine):
    _crafted(ledger_engine)
    now = HOUR + timedelta(minutes=80)
    rollups.roll_up_recent(ledger_engine, hours=2, now=now)
    first = _figures(ledger_engine)
    assert rollups.roll_up_recent(ledger_engine, hours=2, now=now) == 5  # 3 hourly and 2 daily (acme and beta)
    assert _figures(ledger_engine) == first

    ledger.record(ledger_engine, [_row(HOUR + timedelta(minutes=59), costs=("0.5", "0.25"))])  # a late event
    rollups.roll_up_recent(ledger_engine, hours=2, now=now)
    after = _figures(ledger_engine)
    for period, bucket in (("hour", HOUR), ("day", DAY)):
        before, late = first[period, bucket, "acme", "m1"], after[period, bucket, "acme", "m1"]
        assert late["tasks"] == before["tasks"] + 1 and late["sla_met"] == before["sla_met"] + 1
        assert late["list_cost_usd"] == before["list_cost_usd"] + Decimal("0.5")
        assert late["measured_cost_usd"] == before["measured_cost_usd"] + Decimal("0.25")
    assert after["hour", HOUR + timedelta(hours=1), "acme", "m1"] == first["hour", HOUR + timedelta(hours=1), "acme",
                                                                          "m1"]

    with ledger_engine.begin() as connection:  # rows deleted by hand: their figures go at the next re-roll
        connection.execute(delete(LedgerRow).where(LedgerRow.tenant == "beta"))
    rollups.roll_up_recent(ledger_engine, hours=2, now=now)
    assert not [key for key in _rollups(ledger_engine) if key[2] == "beta"]


def test_prune_deletes_only_whole_rolled_up_days_before_the_cut_off(ledger_engine):
    d1, d2, d3 = (datetime(2026, 3, day, tzinfo=UTC) for day in (1, 2, 3))
    ledger.record(ledger_engine, [_row(d1 + timedelta(hours=1)), _row(d1 + timedelta(hours=23)),
                                  _row(d2 + timedelta(hours=5)), _row(d3 + timedelta(hours=1))])
    for day in (d1, d3):  # d2 is never rolled up
        rollups.roll_up(ledger_engine, "hour", day, day + timedelta(days=1))
        rollups.roll_up(ledger_engine, "day", day, day + timedelta(days=1))
    ledger.record(ledger_engine, [_row(d1 + timedelta(hours=2), tenant="gamma")])  # recorded after d1 was rolled
    d1_figures = _rollups(ledger_engine)["day", d1, "acme", "m1"]

    # The cut-off falls in d3: only whole days before it go, and of d1 only the rows its rollup covers
    assert rollups.prune(ledger_engine, d3 + timedelta(hours=12)) == 2
    with ledger_engine.connect() as connection:
        left = sorted((utc(at), tenant) for at, tenant in connection.execute(
            select(LedgerRow.finished_at, LedgerRow.tenant)))
    assert left == [(d1 + timedelta(hours=2), "gamma"), (d2 + timedelta(hours=5), "acme"),
                    (d3 + timedelta(hours=1), "acme")]
    pruned = {key: row["raw_pruned"] for key, row in _rollups(ledger_engine).items()}
    assert pruned == {("hour", d1 + timedelta(hours=1), "acme", "m1"): True,
                      ("hour", d1 + timedelta(hours=23), "acme", "m1"): True, ("day", d1, "acme", "m1"): True,
                      ("hour", d3 + timedelta(hours=1), "acme", "m1"): False, ("day", d3, "acme", "m1"): False}

    # Re-rolling a pruned day keeps the figures its raw rows made (a late row for it is not added)
    ledger.record(ledger_engine, [_row(d1 + timedelta(hours=3))])
    rollups.roll_up(ledger_engine, "day", d1, d1 + timedelta(days=1))
    assert _rollups(ledger_engine)["day", d1, "acme", "m1"]["tasks"] == d1_figures["tasks"] == 2
    assert _rollups(ledger_engine)["day", d1, "gamma", "m1"]["tasks"] == 1  # now rolled up, so prunable
    assert rollups.prune(ledger_engine, d3) == 2 and _raw_count(ledger_engine) == 2
    assert rollups.prune(ledger_engine, d3) == 0


def test_retention_rolls_up_the_days_no_rollup_covered_before_pruning_them(ledger_engine):
    d1, d2, d3 = (datetime(2026, 3, day, tzinfo=UTC) for day in (1, 2, 3))
    ledger.record(ledger_engine, [_row(d1 + timedelta(hours=1)), _row(d2 + timedelta(hours=1), tenant="beta"),
                                  _row(d3 + timedelta(hours=1))])
    assert rollups.roll_up_and_prune(ledger_engine, d3 + timedelta(hours=6)) == 2
    assert _raw_count(ledger_engine) == 1
    days = _rollups(ledger_engine, "day")
    assert {key: (row["tasks"], row["raw_pruned"]) for key, row in days.items()} == {
        ("day", d1, "acme", "m1"): (1, True), ("day", d2, "beta", "m1"): (1, True)}
    assert len(_rollups(ledger_engine, "hour")) == 2
    assert rollups.roll_up_and_prune(ledger_engine, d3 + timedelta(hours=6)) == 0


def test_the_retention_task_runs_eagerly_on_the_settings_database(ledger_engine, redis_url):
    now = datetime.now(UTC)
    ledger.record(ledger_engine, [_row(now - timedelta(days=40)), _row(now - timedelta(days=1))])
    url = ledger_engine.url.render_as_string(hide_password=False)
    keep = celery_app(AccountingSettings(database_url=url, retention_days=0), redis_url)
    assert keep.tasks[APPLY_RETENTION].apply().get() == 0 and _raw_count(ledger_engine) == 2
    app = celery_app(AccountingSettings(database_url=url, retention_days=30), redis_url)
    assert app.tasks[APPLY_RETENTION].apply().get() == 1 and _raw_count(ledger_engine) == 1
    assert [row["tasks"] for row in _rollups(ledger_engine, "day").values()] == [1]


def test_the_broker_url_of_a_unix_socket_is_kombus():
    assert broker_url("unix:///tmp/redis.sock") == "redis+socket:///tmp/redis.sock"
    assert broker_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


WORKER = """
from services.jobs.tasks import run_worker
from services.base.settings import AccountingSettings
settings = AccountingSettings(database_url={url!r}, rollup_interval_s=0.5, rollup_lookback_hours=1)
raise SystemExit(run_worker(settings, {redis_url!r}, key_prefix={prefix!r}, loglevel="WARNING"))
"""


def _wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_a_real_worker_runs_the_beat_schedule_and_delayed_jobs_through_redis(ledger_engine, redis_url, tmp_path):
    """A worker with embedded beat (as `tokenfleet` starts it) in a process of its own: beat's rollups cover the
    last hour; a job sent with .delay() through the broker re-rolls further back."""
    now = datetime.now(UTC)
    recent, old = now - timedelta(minutes=1), now - timedelta(hours=30)
    ledger.record(ledger_engine, [_row(recent, tenant="recent"), _row(old, tenant="old")])
    url, prefix = ledger_engine.url.render_as_string(hide_password=False), f"tokenfleet-celery-test-{uuid.uuid4().hex}:"
    client = redis.Redis.from_url(redis_url)
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen([sys.executable, "-c", WORKER.format(url=url, redis_url=redis_url, prefix=prefix)],
                                  cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    tenants = lambda: {key[2] for key in _rollups(ledger_engine)}
    try:
        assert _wait_for(lambda: tenants() == {"recent"}), log.read_text()[-3000:]  # sent by beat alone
        producer = celery_app(AccountingSettings(database_url=url), redis_url, key_prefix=prefix)
        producer.tasks[ROLLUP_RECENT].delay(hours=48)
        assert _wait_for(lambda: tenants() == {"recent", "old"}), log.read_text()[-3000:]
        # Celery's keys all carry the prefix (none collide with the stack's), the queues included
        keys = {key.decode() for key in client.scan_iter(match=f"{prefix}*")}
        assert f"{prefix}_kombu.binding.{QUEUES[1]}" in keys
        assert not [key for key in client.scan_iter(match="_kombu*")] and not client.exists(*QUEUES)
    finally:
        worker.send_signal(signal.SIGTERM)  # a warm shutdown, as `tokenfleet up` stops it
        code = worker.wait(timeout=20)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()
    assert code == 0, log.read_text()[-3000:]
    old_day = _rollups(ledger_engine)["day", rollups.floor(old, "day"), "old", "m1"]
    assert old_day["tasks"] == 1 and old_day["list_cost_usd"] == Decimal("0.001")
