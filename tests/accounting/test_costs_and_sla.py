"""The cost model against hand-computed figures, and SLA verdicts, goodput and attainment on crafted timings."""

from __future__ import annotations

import math

import pytest

from services.tenancy.prices import PriceTable
from services.tenancy.sla import Attainment, SlaPolicy

PRICES = """
[default]
input = 1.0
cached_input = 0.1
output = 2.0

[models.big]
input = 3.0
cached_input = 0.3
output = 12.0

[worker_classes.h200]
usd_per_hour = 3.6
"""


@pytest.fixture
def prices(tmp_path) -> PriceTable:
    path = tmp_path / "prices.toml"
    path.write_text(PRICES)
    return PriceTable.load(path)


def test_list_cost_charges_computed_cached_and_output_tokens_at_their_prices(prices):
    # 600 computed x $3 + 400 cached x $0.30 + 200 output x $12, per million tokens
    assert math.isclose(prices.list_cost("big", 1000, 400, 200), (1800 + 120 + 2400) / 1e6)


def test_a_response_cache_hit_charges_every_token_at_the_cached_input_price(prices):
    assert math.isclose(prices.list_cost("big", 1000, 0, 200, response_cache_hit=True), 1200 * 0.3 / 1e6)


def test_a_model_the_table_does_not_name_gets_the_default_prices(prices):
    assert math.isclose(prices.list_cost("unknown", 100, 0, 10), (100 * 1.0 + 10 * 2.0) / 1e6)


def test_measured_cost_is_gpu_seconds_at_the_worker_class_hourly_cost(prices):
    assert math.isclose(prices.measured_cost("h200", 0.5), 0.5 * 3.6 / 3600)
    assert prices.measured_cost("unpriced-class", 10.0) == 0.0


def test_the_budget_estimate_assumes_no_cache_and_every_allowed_token(prices):
    assert math.isclose(prices.estimate("big", 100, 50), (300 + 600) / 1e6)


def test_a_broken_price_table_is_refused_with_its_path(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[models.x]\ninput = 1\n")
    with pytest.raises(ValueError, match="bad.toml"):
        PriceTable.load(path)


SLA = SlaPolicy.load()


@pytest.mark.parametrize(("ttft", "tpot", "met"), [(0.5, 0.03, True), (1.5, 0.03, False), (0.5, 0.08, False)])
def test_an_interactive_task_meets_its_sla_only_when_every_objective_holds(ttft, tpot, met):
    assert SLA.of("interactive").met(ttft, tpot, e2e_s=30.0) is met


def test_a_batch_task_is_held_to_end_to_end_time_only():
    assert SLA.of("batch").met(ttft_s=120.0, tpot_s=2.0, e2e_s=1800.0)
    assert not SLA.of("batch").met(ttft_s=1.0, tpot_s=0.01, e2e_s=4000.0)


def test_a_task_that_did_not_finish_never_meets_its_sla():
    assert not SLA.of("interactive").met(0.1, 0.01, 0.2, ok=False)


def test_an_unknown_class_falls_back_to_the_default():
    assert SLA.of("platinum").name == SLA.of(None).name == "interactive"


def test_goodput_counts_tasks_meeting_their_sla_per_second_and_attainment_their_share():
    timings = [(0.2, 0.02), (0.9, 0.04), (1.2, 0.02), (0.3, 0.09), (0.4, 0.01)]  # 3 of 5 meet interactive
    met = sum(SLA.of("interactive").met(ttft, tpot, 1.0) for ttft, tpot in timings)
    window = Attainment(tasks=len(timings), met=met, window_s=10.0)
    assert (window.goodput, window.share) == (0.3, 0.6)
