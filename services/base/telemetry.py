"""OpenTelemetry tracing: one trace per request across gateway -> router -> worker -> accounting, carried
from hop to hop by the `traceparent` on every stream message (W3C trace context).

Each service calls `configure(name)` at start. Spans are exported over OTLP when the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, and as JSON lines to
`TOKENFLEET_TRACE_FILE` when that is set (one file any number of processes append to: what the tests read);
with neither, tracing stays off and costs nothing but the ids. Attribute names follow the OpenTelemetry GenAI
semantic conventions (`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

PROPAGATOR = TraceContextTextMapPropagator()


def configure(service: str) -> None:
    """Installs the process's tracer provider (OpenTelemetry keeps it process-wide) if an exporter is set."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    trace_file = os.environ.get("TOKENFLEET_TRACE_FILE")
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or not (endpoint or trace_file):
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                                        f"tokenfleet-{service}")}))
    if endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if trace_file:
        # One JSON document per line, written as each span ends (appends of one line do not interleave).
        out = open(trace_file, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(
            out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
    trace.set_tracer_provider(provider)


def tracer() -> trace.Tracer:
    return trace.get_tracer("tokenfleet")


def traceparent(span: Span) -> str:
    """The W3C header naming `span` as the parent of the next hop's spans."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent") or new_traceparent()


def new_traceparent() -> str:
    """A valid trace context even with tracing off: the ids still tie a request's log lines together."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


@contextmanager
def hop(name: str, parent: str | None, kind: SpanKind = SpanKind.INTERNAL, attributes: dict | None = None,
        start_s: float | None = None) -> Iterator[Span]:
    """A span for one hop, the child of the `traceparent` the message carried (a new trace if none)."""
    context = PROPAGATOR.extract({"traceparent": parent}) if parent else None
    start_ns = int(start_s * 1e9) if start_s is not None else None
    with tracer().start_as_current_span(name, context=context, kind=kind, attributes=attributes,
                                        start_time=start_ns) as span:
        yield span


def record(name: str, parent: Span | str | None, start_s: float, end_s: float, attributes: dict | None = None) -> None:
    """A finished span with known start and end (queue wait, prefill, decode), the child of `parent` (a span,
    or a message's traceparent)."""
    if isinstance(parent, Span):
        context = trace.set_span_in_context(parent)
    else:
        context = PROPAGATOR.extract({"traceparent": parent}) if parent else None
    span = tracer().start_span(name, context=context, attributes=attributes, start_time=int(start_s * 1e9))
    span.end(end_time=int(max(end_s, start_s) * 1e9))
