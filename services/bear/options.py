"""Command-line options every BEAR command spells the same way, defined once.

Each is a ``typing.Annotated`` alias for a typer option, so a command declares
``nats_url: NatsUrl = DEFAULT_NATS`` and gets the same flag, help text and valid values as every
other command."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from bear.runtime.logging import LogFormat

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
