"""Command-line options every BEAR command spells the same way, defined once.

Each is a ``typing.Annotated`` alias for a typer option, so a command declares
``nats_url: NatsUrl = DEFAULT_NATS`` and gets the same flag, help text and valid values as every
other command."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from bear.runtime.logging import LogFormat
from bear.runtime.tracing import Exporter

DEFAULT_NATS = "nats://127.0.0.1:4222"


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


NatsUrl = Annotated[str, typer.Option("--nats", help="NATS server URL, e.g. nats://127.0.0.1:4222.")]
Prefix = Annotated[str, typer.Option("--prefix", help="Subject prefix of the deployment (bear.submit, bear_instances, …).")]
LogFormatOpt = Annotated[LogFormat, typer.Option("--log-format", help="Log format: console (humans) or json (machines).")]
LogLevelOpt = Annotated[LogLevel, typer.Option("--log-level", help="Log level.")]
MetricsPort = Annotated[int, typer.Option("--metrics-port", min=0, max=65535,
                                          help="Prometheus /metrics port; 0: off.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
TraceExporterOpt = Annotated[Exporter, typer.Option(
    "--trace-exporter", help="Export OpenTelemetry spans: auto (otlp when OTEL_EXPORTER_OTLP_ENDPOINT or "
                             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set, else none), none, console (JSON on "
                             "stderr) or otlp (HTTP/protobuf). The W3C trace context is passed on either way.")]
OtlpEndpoint = Annotated[str | None, typer.Option(
    "--otlp-endpoint", help="OTLP/HTTP traces URL, e.g. http://127.0.0.1:4318/v1/traces (default: the "
                            "OTEL_EXPORTER_OTLP_* variables, else http://localhost:4318/v1/traces).")]


def setup_tracing(service: str, exporter: Exporter, endpoint: str | None) -> None:
    """``bear.runtime.tracing.setup`` for a command: a missing exporter package is a usage error."""
    from bear.runtime import tracing

    try:
        tracing.setup(service, exporter, endpoint)
    except RuntimeError as exc:
        raise typer.BadParameter(str(exc)) from exc
