"""Command-line options every BEAR command spells the same way, defined once.

Each is a ``typing.Annotated`` alias for a typer option, so a command declares
``nats_url: NatsUrl = FIND_NATS`` and gets the same flag, help text and valid values as every
other command. ``--nats`` is resolved here, in one place, for every command: the flag, else
``$BEAR_NATS_URL``, else the stack ``bear up`` runs for this directory (bear.stack.discovery);
with none of them it is empty, and connecting (bear.runtime.service.connect) is the one-line error
"no BEAR stack found" — after the command has checked the rest of its input.

``--nats-creds`` names the NATS identity file the command connects as (bear.runtime.identity);
it is exported as ``$BEAR_NATS_CREDS``, where ``bear.runtime.service.connect`` finds it. A service
takes it from the flag or the environment (``bear up`` sets it per child); a client command
(``bear submit``, ``bear load``) also finds the ``client`` identity of the stack ``bear up`` runs
for this directory."""

from __future__ import annotations

import os
from enum import StrEnum
from typing import Annotated, Any

import typer

from bear.router.policies import REGISTRY, make_policy
from bear.runtime.logging import LogFormat
from bear.runtime.metrics import LOOPBACK
from bear.runtime.tracing import Exporter

FIND_NATS = ""  # the default of --nats: resolve it (flag > BEAR_NATS_URL > running `bear up` > error)


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


PolicyName = StrEnum("PolicyName", {name: name for name in REGISTRY})  # type: ignore[misc]
"""Routing policies by registry name (bear, bear-lagrange and the baselines)."""


def _export_creds(value: str | None) -> str:
    from bear.runtime.identity import CREDS_ENV

    if value:
        os.environ[CREDS_ENV] = value
    return value or ""


def _resolve_client_creds(value: str | None) -> str:
    """flag > $BEAR_NATS_CREDS > the running stack's client identity (none: anonymous)."""
    if not value:
        from bear.stack.discovery import read_state

        rec = read_state()
        found = rec.get("client_creds") if rec is not None else None
        value = found if isinstance(found, str) else ""
    return _export_creds(value)


def _resolve_nats(value: str | None) -> str:
    from bear.stack.discovery import find_nats_url

    return find_nats_url(value or None) or ""


def positive(value: Any) -> Any:
    """typer callback: the value must be > 0."""
    if value is not None and not value > 0:
        raise typer.BadParameter(f"must be > 0, got {value}")
    return value


def policy_list(value: str | None) -> str | None:
    """typer callback: comma-separated routing policy names, each a registered one."""
    if value is None:
        return None
    bad = [p for p in value.split(",") if p.strip() not in REGISTRY]
    if bad:
        raise typer.BadParameter(f"unknown policy {', '.join(map(repr, bad))}; valid: {', '.join(REGISTRY)}")
    return ",".join(p.strip() for p in value.split(","))


def positive_list(value: str | None) -> str | None:
    """typer callback: comma-separated numbers, each > 0."""
    if value is None:
        return None
    try:
        nums = [float(x) for x in value.split(",")]
    except ValueError as exc:
        raise typer.BadParameter(f"expected comma-separated numbers, got {value!r}") from exc
    if not all(x > 0 for x in nums):
        raise typer.BadParameter(f"every value must be > 0, got {value!r}")
    return value


NatsUrl = Annotated[str, typer.Option(
    "--nats", envvar="BEAR_NATS_URL", callback=_resolve_nats, show_default=False,
    help="NATS server URL, e.g. nats://127.0.0.1:4222. Default: $BEAR_NATS_URL, else the stack `bear up` "
         "runs for this directory.")]
_CREDS_HELP = ("NATS identity file to connect as (bear.identity/1 JSON, written by `bear up` or `bear nats config`). "
               "Default: $BEAR_NATS_CREDS")
NatsCreds = Annotated[str, typer.Option("--nats-creds", envvar="BEAR_NATS_CREDS", callback=_export_creds,
                                        show_default=False, help=_CREDS_HELP + "; none: connect without one.")]
ClientNatsCreds = Annotated[str, typer.Option(
    "--nats-creds", envvar="BEAR_NATS_CREDS", callback=_resolve_client_creds, show_default=False,
    help=_CREDS_HELP + ", else the client identity of the stack `bear up` runs for this directory.")]
Prefix = Annotated[str, typer.Option("--prefix", help="Subject prefix of the deployment (bear.submit, bear_instances, …).")]
LogFormatOpt = Annotated[LogFormat, typer.Option("--log-format", help="Log format: console (humans) or json (machines).")]
LogLevelOpt = Annotated[LogLevel, typer.Option("--log-level", help="Log level.")]
MetricsPort = Annotated[int, typer.Option("--metrics-port", min=0, max=65535,
                                          help="Prometheus /metrics port; 0: off.")]
MetricsHost = Annotated[str, typer.Option("--metrics-host",
                                          help="Address /metrics listens on (0.0.0.0: every interface).")]
DEFAULT_METRICS_HOST = LOOPBACK
PolicyOpt = Annotated[PolicyName, typer.Option("--policy", help="Routing policy: bear, bear-lagrange or a baseline.")]
PolicyParamsOpt = Annotated[list[str], typer.Option(
    "--param", help="Policy parameter NAME=VALUE, repeatable: bear overflow=1 (default; a query no instance can "
                    "start in time goes where its own prefill costs least) or overflow=0 (the paper's least "
                    "predicted TTFT); bear-lagrange delta=…; routebalance w_cost=… w_latency=…; score gamma=…")]


def policy_params(policy: str, raw: list[str]) -> dict[str, float]:
    """``--param`` values as the policy's keyword arguments, checked by building the policy once, so
    that a wrong name or value fails before anything starts."""
    out: dict[str, float] = {}
    for item in raw:
        k, _, v = item.partition("=")
        try:
            out[k.strip()] = float(v)
        except ValueError:
            raise typer.BadParameter(f"--param expects NAME=VALUE with a number, got {item!r}") from None
    try:
        make_policy(policy, **out)
    except (TypeError, ValueError) as exc:
        raise typer.BadParameter(f"--param for policy {policy}: {exc}") from None
    return out
JsonOut = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
DeltasOpt = Annotated[bool, typer.Option(
    "--deltas/--no-deltas", help="Publish a bear.delta/1 every step on bear.delta.<id> (estimators apply them "
                                 "in libbea); --no-deltas: full snapshots only, every step.")]
FullEveryOpt = Annotated[int, typer.Option(
    "--full-every", min=0, help="With --deltas: a full bear.snapshot/1 on bear.snapshot.<id> every this many "
                                "steps (1: every step, for tools that read full snapshots; 0: only when a delta "
                                "cannot express the change). Resyncs are answered on bear.resync.<id> either way.")]
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
