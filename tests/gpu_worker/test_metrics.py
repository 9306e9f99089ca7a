"""The worker's Prometheus metrics carry vLLM's names under our prefix, and they move with real requests."""

from __future__ import annotations

import pytest

from tests.stack import MODEL, worker_metric

pytestmark = pytest.mark.usefixtures("stack")

HISTOGRAMS = ("tokenfleet:time_to_first_token_seconds", "tokenfleet:time_per_output_token_seconds",
              "tokenfleet:e2e_request_latency_seconds", "tokenfleet:request_queue_time_seconds")


def _totals(stack, name: str) -> float:
    return sum(worker_metric(status, name, default=0.0) for status in stack.worker_statuses())


def test_finished_requests_are_counted_in_the_latency_histograms(stack):
    before = {name: _totals(stack, name + "_count") for name in HISTOGRAMS}
    for _ in range(3):
        stack.client().completions.create(model=MODEL, prompt="Count me", max_tokens=4, temperature=0)
    for name in HISTOGRAMS:
        assert _totals(stack, name + "_count") == before[name] + 3, name


def test_prefix_cache_and_busy_time_counters_grow_with_work(stack):
    before = {name: _totals(stack, name + "_total") for name in (
        "tokenfleet:prefix_cache_queries", "tokenfleet:engine_busy_seconds")}
    stack.client().completions.create(model=MODEL, prompt="Work " * 40, max_tokens=4, temperature=0)
    for name, value in before.items():
        assert _totals(stack, name + "_total") > value, name
