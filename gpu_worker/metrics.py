"""The worker's Prometheus metrics, read from the engine at scrape time (vLLM's metric names)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gpu_worker.engine import LLMEngine


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
        preemptions = CounterMetricFamily("tokenfleet:num_preemptions", "Sequences preempted", labels=["model"])
        preemptions.add_metric([self.model], stats["num_preemptions"])
        yield preemptions


def serve_metrics(engine: LLMEngine, model: str, port: int) -> int | None:
    """Serves /metrics on `port` (0: any free one) in a background thread; returns the port, None if off."""
    if port < 0:
        return None
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, model))
    server, _ = start_http_server(port, registry=registry)
    return server.server_port
