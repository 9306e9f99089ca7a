"""The ledger's Prometheus counters, counted as rows are first written (a replayed event counts nothing):
cost by model (list and measured), tasks by status, tasks meeting their SLA (goodput is its rate), output
tokens (cost per 1 M output tokens is a ratio of two rates); and the rows a delivery cut turned from ok to
cancelled after they were counted (`p.DeliveryCut`: subtract them from the ok tasks and the SLA-met ones).
Served at the finance API's /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class LedgerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.cost = Counter("tokenfleet:cost_usd", "Cost of recorded tasks, USD (list price or measured GPU time)",
                            ["model", "kind"], registry=self.registry)
        self.tasks = Counter("tokenfleet:tasks", "Recorded tasks by status", ["model", "status"],
                             registry=self.registry)
        self.sla_met = Counter("tokenfleet:sla_met", "Recorded tasks that met their SLA (goodput: its rate)",
                               ["model", "sla_class"], registry=self.registry)
        self.output_tokens = Counter("tokenfleet:output_tokens", "Completion tokens of recorded tasks", ["model"],
                                     registry=self.registry)
        self.delivery_cuts = Counter("tokenfleet:delivery_cuts", "Tasks counted ok whose client did not get the "
                                     "whole response: their rows say cancelled", ["model", "sla_class", "sla_met"],
                                     registry=self.registry)

    def count(self, row: dict) -> None:
        model = row["model"]
        self.cost.labels(model, "list").inc(float(row["list_cost_usd"]))
        self.cost.labels(model, "measured").inc(float(row["measured_cost_usd"]))
        self.tasks.labels(model, row["status"]).inc()
        if row["sla_met"]:
            self.sla_met.labels(model, row["sla_class"]).inc()
        self.output_tokens.labels(model).inc(row["completion_tokens"])

    def cut(self, row: dict) -> None:
        """A row turned from ok to cancelled (its model, SLA class, and whether it had counted as SLA met)."""
        self.delivery_cuts.labels(row["model"], row["sla_class"], str(bool(row["sla_met"])).lower()).inc()
