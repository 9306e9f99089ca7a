"""The finance API against a real SQL ledger (PostgreSQL at DATABASE_URL, else SQLite) and a real (embedded)
Redis holding the API keys: tenant isolation, admin scope, pagination, the CSV export, and the cost and goodput
reports' arithmetic on crafted rows."""

from __future__ import annotations

import csv
import io
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from fastapi.testclient import TestClient

from services.accounting import ledger, reports
from services.accounting.api import create_finance_app
from services.base import protocol as p
from services.base.redis_client import connect
from services.tenancy.prices import PriceTable
from services.tenancy.sla import SlaPolicy

PRICES, SLA = PriceTable.load(), SlaPolicy.load()
T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
DAY = {"start": "2025-03-01T00:00:00Z", "end": "2025-03-02T00:00:00Z"}


@pytest.fixture
def client(ledger_engine, redis_keys):
    redis = connect(redis_keys[0])
    with TestClient(create_finance_app(ledger_engine, redis)) as test_client:
        yield test_client
        test_client.portal.call(redis.aclose)  # the client's connections live on the TestClient's loop


@pytest.fixture
def auth(redis_keys):
    return lambda name: {"authorization": f"Bearer {redis_keys[1][name]}"}


def _row(finished_at: datetime = T0, **fields) -> dict:
    """A realistic ledger row (through ledger.row) with `fields` overriding its columns."""
    event = p.CompletionEvent(
        request_id=uuid.uuid4().hex, model="tokenfleet-large", worker_id="w1", worker_class="cpu",
        api_key_name="acme", finish_reasons=["stop"], usage=p.Usage(prompt_tokens=100, completion_tokens=20),
        timing=p.Timing(queue_s=0.01, ttft_s=0.2, tpot_s=0.02, e2e_s=0.6, engine_s=0.55, engine_step_s=0.36),
        finished_at=finished_at.timestamp())
    return ledger.row(event, PRICES, SLA) | fields


def _record(engine, rows: list[dict]) -> None:
    assert len(ledger.record(engine, rows)) == len(rows)


def _tenants_and_models(engine) -> None:
    _record(engine, [_row(tenant="acme"), _row(tenant="acme", model="tokenfleet-small"), _row(tenant="globex")])


def _csv(response) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(response.text)))


def test_a_tenant_sees_only_its_own_rows_as_json(client, auth, ledger_engine):
    _tenants_and_models(ledger_engine)
    rows = client.get("/v1/ledger", headers=auth("globex")).json()["data"]
    assert [row["tenant"] for row in rows] == ["globex"]


def test_a_tenant_sees_only_its_own_rows_as_csv(client, auth, ledger_engine):
    _tenants_and_models(ledger_engine)
    response = client.get("/v1/ledger", headers=auth("globex") | {"accept": "text/csv"})
    assert response.headers["content-type"].startswith("text/csv")
    assert [row["tenant"] for row in _csv(response)] == ["globex"]


def test_an_admin_sees_every_tenants_rows(client, auth, ledger_engine):
    _tenants_and_models(ledger_engine)
    rows = client.get("/v1/ledger", headers=auth("ops")).json()["data"]
    assert sorted(row["tenant"] for row in rows) == ["acme", "acme", "globex"]


def test_an_admin_may_filter_by_tenant(client, auth, ledger_engine):
    _tenants_and_models(ledger_engine)
    rows = client.get("/v1/ledger", params={"tenant": "acme"}, headers=auth("ops")).json()["data"]
    assert sorted(row["model"] for row in rows) == ["tokenfleet-large", "tokenfleet-small"]


def test_a_missing_key_is_401_with_an_openai_error(client):
    response = client.get("/v1/ledger")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_an_unknown_key_is_401(client):
    response = client.get("/v1/reports/cost", headers={"authorization": "Bearer tf-not-a-key"})
    assert response.status_code == 401


def test_a_tenant_asking_for_another_tenant_gets_403(client, auth):
    response = client.get("/v1/ledger", params={"tenant": "globex"}, headers=auth("acme"))
    assert response.status_code == 403
    assert response.json()["error"]["param"] == "tenant"


def test_keyset_pagination_walks_every_row_exactly_once(client, auth, ledger_engine):
    _record(ledger_engine, [_row(tenant="acme") for _ in range(23)] + [_row(tenant="globex")])
    seen, after, pages = [], None, 0
    while True:
        params = {"limit": 5} | ({"after": after} if after is not None else {})
        body = client.get("/v1/ledger", params=params, headers=auth("acme")).json()
        seen += [row["id"] for row in body["data"]]
        pages += 1
        if not body["has_more"]:
            assert body["next_after"] is None
            break
        after = body["next_after"]
    assert pages == 5 and len(seen) == 23 and seen == sorted(set(seen))


def test_filters_select_by_model_status_and_half_open_time_window(client, auth, ledger_engine):
    _record(ledger_engine, [
        _row(T0, request_id="hit"), _row(T0 + timedelta(hours=1), request_id="at-end"),
        _row(T0 - timedelta(seconds=1), request_id="before"), _row(T0, request_id="small", model="tokenfleet-small"),
        _row(T0, request_id="failed", status="error")])
    params = {"model": "tokenfleet-large", "status": "ok", "start": "2025-03-01T12:00:00Z",
              "end": "2025-03-01T13:00:00+00:00"}
    rows = client.get("/v1/ledger", params=params, headers=auth("acme")).json()["data"]
    assert [row["request_id"] for row in rows] == ["hit"]


def test_csv_has_a_header_and_every_matching_row_with_decimal_money_and_iso_times(client, auth, ledger_engine):
    cost = Decimal("0.000123456789")
    _record(ledger_engine, [_row(T0 + timedelta(seconds=i), list_cost_usd=cost) for i in range(1205)])
    response = client.get("/v1/ledger", headers=auth("acme") | {"accept": "text/csv"})
    assert response.text.splitlines()[0].split(",") == reports.FIELDS
    rows = _csv(response)
    assert len(rows) == 1205 and len({row["id"] for row in rows}) == 1205  # no pagination, no repeats
    assert rows[0]["list_cost_usd"] == "0.000123456789" and rows[0]["sla_met"] == "true"
    assert rows[7]["finished_at"] == "2025-03-01T12:00:07+00:00"


def test_json_rows_carry_money_as_decimal_strings_and_times_as_iso(client, auth, ledger_engine):
    _record(ledger_engine, [_row(list_cost_usd=Decimal("0.000000000120"), measured_cost_usd=Decimal(0))])
    [row] = client.get("/v1/ledger", headers=auth("acme")).json()["data"]
    assert (row["list_cost_usd"], row["measured_cost_usd"]) == ("0.000000000120", "0.000000000000")
    assert row["finished_at"] == "2025-03-01T12:00:00+00:00"


def _cost_rows() -> list[dict]:
    large = dict(tenant="acme", model="tokenfleet-large")
    return [
        _row(**large, prompt_tokens=100, cached_tokens=40, completion_tokens=20,
             list_cost_usd=Decimal("0.001000000001"), measured_cost_usd=Decimal("0.000400000000")),
        _row(**large, prompt_tokens=300, cached_tokens=0, completion_tokens=30,
             list_cost_usd=Decimal("0.002499999999"), measured_cost_usd=Decimal("0.000100000000")),
        _row(tenant="acme", model="tokenfleet-small", completion_tokens=0, list_cost_usd=Decimal("0.000000000500")),
        _row(tenant="globex", model="tokenfleet-large", completion_tokens=10, list_cost_usd=Decimal("0.5")),
        _row(T0 + timedelta(days=1), **large, list_cost_usd=Decimal("9")),  # outside the window
    ]


def test_cost_report_sums_tokens_and_costs_per_tenant_and_model(client, auth, ledger_engine):
    _record(ledger_engine, _cost_rows())
    body = client.get("/v1/reports/cost", params=DAY, headers=auth("ops")).json()
    by_key = {(group["tenant"], group["model"]): group for group in body["data"]}
    assert sorted(by_key) == [("acme", "tokenfleet-large"), ("acme", "tokenfleet-small"),
                              ("globex", "tokenfleet-large")]
    large = by_key["acme", "tokenfleet-large"]
    assert (large["tasks"], large["prompt_tokens"], large["cached_tokens"], large["completion_tokens"]) == (
        2, 400, 40, 50)
    assert (large["list_cost_usd"], large["measured_cost_usd"]) == ("0.003500000000", "0.000500000000")
    # 0.0035 USD / 50 output tokens x 1 M = 70 USD; 0.0005 / 50 x 1 M = 10 USD
    assert (large["list_usd_per_1m_output_tokens"], large["measured_usd_per_1m_output_tokens"]) == (
        "70.000000", "10.000000")
    assert by_key["acme", "tokenfleet-small"]["list_usd_per_1m_output_tokens"] is None  # no output tokens


def test_cost_report_for_a_tenant_covers_only_its_own_rows(client, auth, ledger_engine):
    _record(ledger_engine, _cost_rows())
    body = client.get("/v1/reports/cost", params=DAY, headers=auth("globex")).json()
    assert [(g["tenant"], g["model"], g["tasks"], g["list_cost_usd"]) for g in body["data"]] == [
        ("globex", "tokenfleet-large", 1, "0.500000000000")]


def test_cost_report_grouped_by_hour_buckets_tasks_by_utc_hour(client, auth, ledger_engine):
    minutes = (10, 50, 65, 24 * 60 - 1)
    _record(ledger_engine, [_row(T0 + timedelta(minutes=m), list_cost_usd=Decimal(m)) for m in minutes])
    params = DAY | {"group_by": "hour"}
    groups = client.get("/v1/reports/cost", params=params, headers=auth("acme")).json()["data"]
    assert [(g["bucket"], g["tasks"], g["list_cost_usd"]) for g in groups] == [
        ("2025-03-01T12:00:00+00:00", 2, "60.000000000000"), ("2025-03-01T13:00:00+00:00", 1, "65.000000000000")]


def test_cost_report_grouped_by_day_buckets_tasks_by_utc_day(client, auth, ledger_engine):
    _record(ledger_engine, [_row(T0), _row(T0 + timedelta(hours=11, minutes=59)), _row(T0 + timedelta(hours=12))])
    params = {"start": "2025-03-01", "end": "2025-03-03", "group_by": "day"}
    groups = client.get("/v1/reports/cost", params=params, headers=auth("acme")).json()["data"]
    assert [(g["bucket"], g["tasks"]) for g in groups] == [
        ("2025-03-01T00:00:00+00:00", 2), ("2025-03-02T00:00:00+00:00", 1)]


def _goodput_rows() -> list[dict]:
    """Interactive: five ok tasks (three meet the SLA, TTFTs 0.1..0.5 s) and a failed one; batch: one, met."""
    ok = [_row(ttft_s=0.1 * i, tpot_s=0.01 * i, sla_class="interactive", sla_met=i <= 3) for i in range(1, 6)]
    failed = _row(ttft_s=9.0, tpot_s=9.0, sla_class="interactive", sla_met=False, status="error")
    return [*ok, failed, _row(sla_class="batch", sla_met=True)]


HOUR = {"start": "2025-03-01T12:00:00Z", "end": "2025-03-01T13:00:00Z"}


def test_goodput_report_counts_attainment_goodput_and_latency_percentiles(client, auth, ledger_engine):
    _record(ledger_engine, _goodput_rows())
    body = client.get("/v1/reports/goodput", params=HOUR, headers=auth("acme")).json()
    assert body["window_s"] == 3600
    groups = {group["sla_class"]: group for group in body["data"]}
    interactive = groups["interactive"]
    assert (interactive["tasks"], interactive["met"], interactive["ok"]) == (6, 3, 5)
    assert interactive["attainment"] == pytest.approx(0.5)
    assert interactive["goodput"] == pytest.approx(3 / 3600)
    # numpy's linear percentiles of 0.1..0.5 (the failed task's 9 s is left out): ranks 2, 3.8 and 3.96 of 0..4
    assert interactive["ttft_s"] == pytest.approx({"p50": 0.3, "p95": 0.48, "p99": 0.496})
    assert interactive["tpot_s"] == pytest.approx({"p50": 0.03, "p95": 0.048, "p99": 0.0496})
    assert (groups["batch"]["tasks"], groups["batch"]["goodput"]) == (1, pytest.approx(1 / 3600))


def _goodput_groups(client, auth) -> dict[tuple[str, str], dict]:
    body = client.get("/v1/reports/goodput", params=HOUR, headers=auth("acme")).json()
    return {(group["model"], group["sla_class"]): group for group in body["data"]}


def test_goodput_report_counts_rejected_tasks_apart_leaving_attainment_and_goodput_as_they_were(
        client, auth, ledger_engine):
    _record(ledger_engine, _goodput_rows())
    before = _goodput_groups(client, auth)
    # refused for the client's own fault: instant, so their timings would flatter the percentiles
    _record(ledger_engine, [_row(ttft_s=0.0, tpot_s=0.0, e2e_s=0.0, sla_class="interactive", sla_met=False,
                                 status="rejected") for _ in range(3)])
    after = _goodput_groups(client, auth)
    interactive = ("tokenfleet-large", "interactive")
    assert before[interactive]["rejected"] == 0
    assert after[interactive] == before[interactive] | {"rejected": 3}
    assert after[interactive]["attainment"] == pytest.approx(3 / 6)


def test_goodput_report_lists_a_group_of_rejected_tasks_alone_with_no_tasks_attainment_or_percentiles(
        client, auth, ledger_engine):
    _record(ledger_engine, [_row(model="tokenfleet-small", sla_met=False, status="rejected")])
    [group] = _goodput_groups(client, auth).values()
    assert {key: group[key] for key in ("tasks", "met", "ok", "rejected", "attainment", "goodput")} == {
        "tasks": 0, "met": 0, "ok": 0, "rejected": 1, "attainment": 0.0, "goodput": 0.0}
    assert group["ttft_s"] == group["tpot_s"] == {"p50": None, "p95": None, "p99": None}


@pytest.mark.parametrize(("path", "params", "param"), [
    ("/v1/ledger", {"start": "2025-02-30"}, "start"),
    ("/v1/reports/cost", {"end": "yesterday"}, "end"),
    ("/v1/reports/goodput", {"start": "2025-03-02", "end": "2025-03-01"}, "end"),
    ("/v1/ledger", {"limit": 1001}, "limit"),
    ("/v1/ledger", {"after": "x"}, "after"),
    ("/v1/ledger", {"status": "done"}, "status"),
    ("/v1/reports/cost", {"group_by": "week"}, "group_by"),
])
def test_a_bad_query_value_is_400_naming_the_param(client, auth, path, params, param):
    response = client.get(path, params=params, headers=auth("acme"))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
