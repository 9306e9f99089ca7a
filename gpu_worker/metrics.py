"""The worker's Prometheus metrics under vLLM's names with our prefix: engine state read at scrape time,
and per-request latency histograms observed as requests finish."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gpu_worker.engine import LLMEngine
from services.base import protocol as p

# vLLM's buckets for the same histograms (seconds): the dashboards people already have read them.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class EngineCollector:
    def __init__(self, engine: LLMEngine, model: str):
        self.engine, self.model = engine, model

    def collect(self):
        stats = self.engine.stats()
        gauges = {
            "tokenfleet:num_requests_running": ("Requests in the running batch", stats["num_requests_running"]),
            "tokenfleet:num_requests_waiting": ("Requests waiting for KV blocks", stats["num_requests_waiting"]),
            "tokenfleet:kv_blocks_used": ("KV-cache blocks in use", stats["kv_blocks_used"]),
            "tokenfleet:kv_blocks_total": ("KV-cache blocks in the pool", stats["kv_blocks_total"]),
            "tokenfleet:kv_cache_usage_perc": ("Fraction of KV-cache blocks in use", stats["kv_cache_usage"]),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=["model"])
            family.add_metric([self.model], value)
            yield family
        counters = {
            "tokenfleet:num_preemptions": ("Sequences preempted", stats["num_preemptions"]),
            "tokenfleet:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                                stats["prefix_cache_queries"]),
            "tokenfleet:prefix_cache_hits": ("Prompt tokens found in the prefix cache", stats["prefix_cache_hits"]),
            "tokenfleet:engine_busy_seconds": ("Wall time of every engine step (utilization = its rate)",
                                               stats["busy_seconds"]),
            "tokenfleet:spec_decode_num_drafts": ("Steps in which a sequence had speculative guesses scored",
                                                  stats["spec_decode_num_drafts"]),
            "tokenfleet:spec_decode_num_draft_tokens": ("Tokens proposed for speculative decoding",
                                                        stats["spec_decode_num_draft_tokens"]),
            "tokenfleet:spec_decode_num_accepted_tokens": ("Proposed tokens the model agreed with",
                                                           stats["spec_decode_num_accepted_tokens"]),
        }
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(name, doc, labels=["model"])
            family.add_metric([self.model], value)
            yield family
        yield self._accepted_per_position()

    def _accepted_per_position(self) -> CounterMetricFamily:
        """Acceptance rate is accepted / draft tokens, mean acceptance length 1 + accepted / drafts, and the
        acceptance at position i accepted_per_pos{position=i} / drafts: rates of these counters, as in vLLM."""
        family = CounterMetricFamily("tokenfleet:spec_decode_num_accepted_tokens_per_pos",
                                     "Drafts whose guess at this position was kept", labels=["model", "position"])
        for position, count in enumerate(self.engine.speculation.accepted_per_position):
            family.add_metric([self.model, str(position)], count)
        return family


class WorkerMetrics:
    def __init__(self, engine: LLMEngine, model: str):
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=self.registry)

        self.ttft = histogram("tokenfleet:time_to_first_token_seconds", "Enqueued to first token", TTFT_BUCKETS)
        self.tpot = histogram("tokenfleet:time_per_output_token_seconds", "Mean time per output token after the "
                              "first", TPOT_BUCKETS)
        self.e2e = histogram("tokenfleet:e2e_request_latency_seconds", "Enqueued to finished", E2E_BUCKETS)
        self.queue = histogram("tokenfleet:request_queue_time_seconds", "Enqueued to admitted by the engine",
                               TTFT_BUCKETS)

    def observe(self, timing: p.Timing, completion_tokens: int) -> None:
        self.ttft.labels(self.model).observe(timing.ttft_s)
        if completion_tokens > 1:
            self.tpot.labels(self.model).observe(timing.tpot_s)
        self.e2e.labels(self.model).observe(timing.e2e_s)
        self.queue.labels(self.model).observe(timing.queue_s)

    def serve(self, port: int) -> int | None:
        """Serves /metrics on `port` (0: any free one) in a background thread; returns the port, None if off."""
        if port < 0:
            return None
        server, _ = start_http_server(port, registry=self.registry)
        return server.server_port
