"""When each moment of a request happened on its worker, for its completion event's timing (TTFT, TPOT, queue
and engine time) and its trace's spans."""

from __future__ import annotations

import time

from opentelemetry import trace

from services.base import protocol as p
from services.base import telemetry


class RequestClock:
    """Wall-clock times of one request, from its enqueueing at the gateway (seconds since the epoch)."""

    def __init__(self, enqueued_at: float, first_token_at: float | None, routed_at: float | None = None):
        self.enqueued_at, self.routed_at = enqueued_at, routed_at
        self.admitted_at = time.time()
        self.first_token_at = first_token_at

    def token(self) -> None:
        self.first_token_at = self.first_token_at or time.time()

    def trace(self, request: p.GenerateRequest, usage: p.Usage) -> None:
        """Queue wait (routed -> taken by this worker), prefill (-> first token) and decode (-> now) as spans of
        the worker's hop, and the GenAI usage attributes on it."""
        now, hop = time.time(), trace.get_current_span()
        routed = request.routing.decided_at if request.routing else self.enqueued_at
        first = self.first_token_at or now
        telemetry.record("queue worker", hop, routed, self.admitted_at)
        telemetry.record("prefill", hop, self.admitted_at, first, {"gen_ai.usage.input_tokens": usage.prompt_tokens})
        telemetry.record("decode", hop, first, now, {"gen_ai.usage.output_tokens": usage.completion_tokens})
        hop.set_attributes({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                            "gen_ai.usage.output_tokens": usage.completion_tokens,
                            "tokenfleet.cached_tokens": usage.cached_tokens})

    def timing(self, completion_tokens: int, engine_step_s: float) -> p.Timing:
        now = time.time()
        first = self.first_token_at or now
        tpot = (now - first) / (completion_tokens - 1) if completion_tokens > 1 else 0.0
        return p.Timing(queue_s=self.admitted_at - self.enqueued_at, ttft_s=first - self.enqueued_at, tpot_s=tpot,
                        e2e_s=now - self.enqueued_at, engine_s=now - self.admitted_at, engine_step_s=engine_step_s,
                        route_s=None if self.routed_at is None else self.routed_at - self.enqueued_at)
