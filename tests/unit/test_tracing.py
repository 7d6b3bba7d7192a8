"""Which exporters the environment selects, the resource's names, and handlers that continue a message's trace
while background traffic (no trace context) runs in no span at all."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from shared import tracing

PARENT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({}, []),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp", "DEEPINFER_TRACE": "file:/tmp/s.jsonl"}, ["otlp", "file:/tmp/s.jsonl"]),
        ({"OTEL_TRACES_EXPORTER": "console", "DEEPINFER_TRACE": "console"}, ["console"]),
    ],
)
def test_exporters_from_the_environment(env: dict[str, str], names: list[str]) -> None:
    assert tracing.exporter_names(env) == names


def test_unsupported_exporters_are_named() -> None:
    with pytest.raises(ValueError, match="grpc"):
        tracing._exporter("otlp", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(ValueError, match="zipkin"):
        tracing._exporter("zipkin", {})
    exporter = tracing._exporter("otlp", {})
    assert type(exporter).__name__ == "OTLPSpanExporter"


def test_resource_names() -> None:
    attrs = tracing.resource("decode", "decode-1", {}).attributes
    assert (attrs["service.name"], attrs["service.instance.id"], attrs["service.namespace"]) == (
        "decode", "decode-1", "deepinfer")
    assert tracing.resource("decode", "decode-1", {"OTEL_SERVICE_NAME": "dc"}).attributes["service.name"] == "dc"


def test_only_traced_messages_get_spans() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    original = tracing.tracer
    tracing.tracer = lambda: tracer  # type: ignore[assignment]
    try:
        with tracer.start_as_current_span("unrelated task context"):
            with tracing.handling("bg workers.heartbeat", {}, SpanKind.CONSUMER):
                # detached: nothing sent from here carries the surrounding span on
                assert not trace.get_current_span().get_span_context().is_valid
                assert tracing.inject() == {}
        with tracing.handling("req tokens.r", PARENT, SpanKind.CONSUMER):
            sent = tracing.inject()
    finally:
        tracing.tracer = original  # type: ignore[assignment]
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"unrelated task context", "req tokens.r"}
    child = spans["req tokens.r"]
    assert child.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736 and child.parent.span_id == 0x00F067AA0BA902B7
    assert sent["traceparent"].split("-")[1] == PARENT["traceparent"].split("-")[1]
    assert tracing.continued({}) is None and tracing.continued({"traceparent": "garbage"}) is None
