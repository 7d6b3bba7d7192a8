"""OpenTelemetry: one tracer provider per process, W3C trace context carried in NATS message headers.

Exporter by `DEEPINFER_TRACE`: "none" (default: spans are made and propagated, nothing is exported),
"console", or "file:PATH" (one JSON span per line, appended; several processes may share the file).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Context = otel_context.Context
_propagator = TraceContextTextMapPropagator()


class JsonLinesExporter(SpanExporter):
    """Appends spans to a file, one JSON object a line (O_APPEND keeps lines whole across processes)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(s.to_json(indent=None) + "\n" for s in spans)
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def setup(service: str, instance: str) -> None:
    provider = TracerProvider(
        resource=Resource.create({"service.name": service, "service.instance.id": instance})
    )
    mode = os.environ.get("DEEPINFER_TRACE", "none")
    if mode == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif mode.startswith("file:"):
        provider.add_span_processor(BatchSpanProcessor(JsonLinesExporter(mode[len("file:") :])))
    trace.set_tracer_provider(provider)


def shutdown() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer("deepinfer")


def inject(ctx: Context | None = None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return carrier


def extract(headers: Mapping[str, str] | None) -> Context:
    return _propagator.extract(headers or {})


def current() -> Context:
    return otel_context.get_current()
