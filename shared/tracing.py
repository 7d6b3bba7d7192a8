"""OpenTelemetry: one tracer provider per process, W3C trace context carried in NATS message headers.

Exporters, any combination:
- OTLP/HTTP (protobuf) when `OTEL_TRACES_EXPORTER` names `otlp`, or when it is unset and an OTLP endpoint is set
  (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_EXPORTER_OTLP_ENDPOINT` + "/v1/traces"). The exporter and the
  batch processor read the other standard variables themselves (`OTEL_EXPORTER_OTLP_HEADERS`, `..._TIMEOUT`,
  `..._COMPRESSION`, `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_BSP_MAX_QUEUE_SIZE`...); the sampler reads
  `OTEL_TRACES_SAMPLER`. Unlike the SDK's own default, nothing is exported with no variable set: a service must
  not spend its time failing to reach a collector nobody started.
- `OTEL_TRACES_EXPORTER=console`, or `DEEPINFER_TRACE=console`: spans printed on stdout.
- `DEEPINFER_TRACE=file:PATH`: one JSON span per line, appended (several processes may share the file).

Resource: service.name is the service ("gateway", "recipe", ...) unless `OTEL_SERVICE_NAME` says otherwise (one
name per process: leave it unset under `deepinfer up`, where six processes share one environment);
`OTEL_RESOURCE_ATTRIBUTES` adds attributes; service.namespace "deepinfer" and service.instance.id are ours.

Spans begin at the edge: an HTTP request to the API (or a client's traceparent) starts a trace, and every bus
message sent inside it carries it on. A message that carries no trace (heartbeats, KV events, health polls,
metrics scrapes, snapshots) is handled without any span: background traffic never makes root spans.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence

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
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

Context = otel_context.Context
_propagator = TraceContextTextMapPropagator()

OTLP_PROTOCOLS = ("http/protobuf", "")  # the installed exporter; grpc needs opentelemetry-exporter-otlp-proto-grpc


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


def exporter_names(env: Mapping[str, str]) -> list[str]:
    """The exporters `env` asks for: OTEL_TRACES_EXPORTER's list, plus DEEPINFER_TRACE's ("console", "file:P")."""
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names and (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        names = ["otlp"]
    own = env.get("DEEPINFER_TRACE", "none")
    if own == "console" or own.startswith("file:"):
        names.append(own)
    return [n for n in dict.fromkeys(names) if n != "none"]


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == "otlp":
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", ""))
        if protocol not in OTLP_PROTOCOLS:
            raise ValueError(f"OTLP protocol {protocol!r} is not supported: use http/protobuf")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # only when used

        return OTLPSpanExporter()  # endpoint, headers, timeout and compression from the OTEL_* variables
    if name == "console":
        return ConsoleSpanExporter()
    if name.startswith("file:"):
        return JsonLinesExporter(name[len("file:") :])
    raise ValueError(f"unknown trace exporter {name!r} (OTEL_TRACES_EXPORTER: otlp, console, none)")


def resource(service: str, instance: str, env: Mapping[str, str]) -> Resource:
    # Resource.create adds OTEL_RESOURCE_ATTRIBUTES; the attributes given here win over them, and
    # OTEL_SERVICE_NAME over our default name, as the specification orders them.
    name = env.get("OTEL_SERVICE_NAME") or service
    return Resource.create(
        {"service.name": name, "service.namespace": "deepinfer", "service.instance.id": instance}
    )


def setup(service: str, instance: str, env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    provider = TracerProvider(resource=resource(service, instance, env))
    for name in exporter_names(env):
        try:
            provider.add_span_processor(BatchSpanProcessor(_exporter(name, env)))
        except ValueError as exc:  # a misconfigured exporter must not stop the service: say so, serve untraced
            log.error("tracing: %s", exc)
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


def continued(headers: Mapping[str, str] | None) -> Context | None:
    """The trace a message carries on, or None when it carries none (background traffic)."""
    ctx = extract(headers)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


@contextlib.contextmanager
def within(name: str, ctx: Context | None, kind: SpanKind = SpanKind.INTERNAL) -> Iterator[None]:
    """Run inside a span that continues the trace in `ctx`; when `ctx` holds none, in no span at all, detached
    from whatever context the running task had (so nothing sent from there carries a trace it is not part of)."""
    if ctx is None or not trace.get_current_span(ctx).get_span_context().is_valid:
        token = otel_context.attach(Context())
        try:
            yield
        finally:
            otel_context.detach(token)
        return
    with tracer().start_as_current_span(name, context=ctx, kind=kind):
        yield


def handling(name: str, headers: Mapping[str, str] | None, kind: SpanKind) -> contextlib.AbstractContextManager[None]:
    """A message handler's span: continues the trace the message carries, none for background traffic."""
    return within(name, extract(headers), kind)


def current() -> Context:
    return otel_context.get_current()
