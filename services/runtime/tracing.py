"""One trace per query across gateway → router → predictor / estimator → engine (OpenTelemetry,
W3C trace context).

Every hop carries ``traceparent`` (and ``tracestate``) downstream: in NATS headers between BEAR
services, as an HTTP header to the engine (vLLM reads it; its own spans join the trace when it runs
with ``--otlp-traces-endpoint``). A process exports spans only when :func:`setup` was given an
exporter (``otlp`` or ``console``); otherwise nothing of OpenTelemetry is imported and
:func:`child` only hands the incoming trace context on unchanged — a dict lookup per hop, so a
trace started by a client still reaches the engine through untraced BEAR processes."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

import structlog

log = structlog.get_logger("bear.tracing")

CONTEXT_HEADERS = ("traceparent", "tracestate")


class Exporter(StrEnum):
    auto = "auto"  # otlp when the standard OTLP endpoint variables are set, else none
    none = "none"
    console = "console"
    otlp = "otlp"


_tracer: Any = None
_provider: Any = None


def default_exporter() -> Exporter:
    """``otlp`` when the standard OTLP endpoint variables are set, else ``none``."""
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return Exporter.otlp
    return Exporter.none


def setup(service: str, exporter: Exporter | str = Exporter.auto, endpoint: str | None = None) -> None:
    """Export this process's spans as ``service`` (``service.name``): ``otlp`` over HTTP/protobuf to
    ``endpoint`` (a full ``…/v1/traces`` URL; default: the OTEL_EXPORTER_OTLP_* variables, else
    http://localhost:4318/v1/traces), ``console`` as JSON on stderr, ``none`` not at all. Spans are
    batched and sent from a background thread, never on the event loop."""
    global _tracer, _provider
    exporter = Exporter(exporter)
    if exporter is Exporter.auto:
        exporter = default_exporter()
    if exporter is Exporter.none:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter is Exporter.otlp:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError("--trace-exporter otlp needs the OTLP exporter: pip install "
                               "'bear-router[otlp]' (opentelemetry-exporter-otlp-proto-http)") from exc
        span_exporter: Any = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    else:
        span_exporter = ConsoleSpanExporter(out=sys.stderr)
    _provider = TracerProvider(resource=Resource.create({"service.name": service}))
    _provider.add_span_processor(BatchSpanProcessor(span_exporter, schedule_delay_millis=500))
    _tracer = _provider.get_tracer("bear")
    log.info("tracing on", service=service, exporter=str(exporter), endpoint=endpoint or "default")


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Flush and stop the exporter (call once at process exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def passthrough(carrier: Mapping[str, str] | None) -> dict[str, str] | None:
    """The trace-context headers of ``carrier`` (HTTP or NATS headers), or None when it has none."""
    if not carrier:
        return None
    tp = carrier.get("traceparent")
    if not tp:
        return None
    out = {"traceparent": tp}
    ts = carrier.get("tracestate")
    if ts:
        out["tracestate"] = ts
    return out


class Span:
    """What :func:`child` yields: ``headers`` to send downstream (None: no trace context), and
    attribute/event setters that do nothing when tracing is off."""

    __slots__ = ("headers", "span")

    def __init__(self, headers: dict[str, str] | None, span: Any = None) -> None:
        self.headers = headers
        self.span = span

    def set(self, **attrs: Any) -> None:
        if self.span is not None:
            for k, v in attrs.items():
                if v is not None:
                    self.span.set_attribute(k, v)

    def event(self, name: str, at: float | None = None, **attrs: Any) -> None:
        """An event now, or at ``at`` (epoch seconds)."""
        if self.span is not None:
            self.span.add_event(name, {k: v for k, v in attrs.items() if v is not None},
                                timestamp=None if at is None else int(at * 1e9))

    def error(self, message: str) -> None:
        if self.span is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, message))


@contextmanager
def child(name: str, parent: Mapping[str, str] | None, *, kind: str = "internal", **attrs: Any) -> Iterator[Span]:
    """A span ``name`` whose parent is the trace context in ``parent`` (headers; None or absent: a
    new trace). ``kind``: internal, server, client, producer or consumer. Tracing off: no span, and
    the yielded headers are ``parent``'s own trace context (passed on unchanged)."""
    if _tracer is None:
        yield Span(passthrough(parent))
        return
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    prop = TraceContextTextMapPropagator()
    ctx = prop.extract(parent) if parent else None
    span_kind = getattr(trace.SpanKind, kind.upper())
    with _tracer.start_as_current_span(name, context=ctx, kind=span_kind, record_exception=True,
                                       set_status_on_exception=True) as span:
        for k, v in attrs.items():
            if v is not None:
                span.set_attribute(k, v)
        headers: dict[str, str] = {}
        prop.inject(headers, context=trace.set_span_in_context(span))
        yield Span(headers or None, span)
