"""OpenTelemetry across the stack: a request's spans in gateway, router, worker and accounting share one trace,
each hop the child of the one before, with queue, prefill and decode spans and GenAI attributes."""

from __future__ import annotations

import json
import secrets
import time

import pytest

from tests.stack import MODEL

pytestmark = pytest.mark.usefixtures("stack")


def _spans(stack, trace_id: str, last: str = "ledger.record", timeout_s: float = 10) -> list[dict]:
    """The trace's spans once its last hop's span is written (frameworks may add spans of their own)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [span for line in stack.trace_file.read_text().splitlines()
                 if (span := json.loads(line))["context"]["trace_id"] == "0x" + trace_id]
        if any(span["name"] == last for span in spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def test_one_trace_spans_every_hop_from_the_clients_traceparent(stack):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    response = stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Trace me."}], max_tokens=3,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    spans = _spans(stack, trace_id)
    by_name = {span["name"]: span for span in spans}
    service = {span["name"]: span["resource"]["attributes"]["service.name"] for span in spans}
    assert service[f"chat {MODEL}"] == "tokenfleet-gateway" and service["route"] == "tokenfleet-router"
    assert service[f"generate {MODEL}"] == "tokenfleet-worker" and service["ledger.record"] == "tokenfleet-accounting"

    def parent(name: str) -> str:
        return by_name[name]["parent_id"]

    def span_id(name: str) -> str:
        return by_name[name]["context"]["span_id"]

    assert parent(f"chat {MODEL}") == "0x" + client_span
    assert parent("route") == parent("queue router") == span_id(f"chat {MODEL}")
    assert parent(f"generate {MODEL}") == span_id("route")
    assert {parent(n) for n in ("queue worker", "prefill", "decode")} == {span_id(f"generate {MODEL}")}
    assert parent("ledger.record") == span_id(f"generate {MODEL}")
    gateway, worker = by_name[f"chat {MODEL}"]["attributes"], by_name[f"generate {MODEL}"]["attributes"]
    assert gateway["gen_ai.request.model"] == MODEL and gateway["gen_ai.operation.name"] == "chat"
    assert (worker["gen_ai.usage.input_tokens"], worker["gen_ai.usage.output_tokens"]) == (
        response.usage.prompt_tokens, response.usage.completion_tokens)
