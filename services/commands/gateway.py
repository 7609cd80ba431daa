"""``bear gateway`` (the OpenAI-compatible HTTP front of the routers) and ``bear bench gateway``.
Heavy imports stay inside the command functions."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from bear.commands.options import (
    FIND_NATS,
    LogFormatOpt,
    LogLevel,
    LogLevelOpt,
    NatsCreds,
    NatsUrl,
    OtlpEndpoint,
    Prefix,
    TraceExporterOpt,
    setup_tracing,
)
from bear.protocol.codec import json_safe
from bear.runtime import aio
from bear.runtime.logging import LogFormat, configure_logging
from bear.runtime.tracing import Exporter


def gateway(
    nats_url: NatsUrl = FIND_NATS,
    nats_creds: NatsCreds = "",
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="HTTP port; the API is at /v1"),
    api_key_file: Path | None = typer.Option(
        None, "--api-key-file", help="File of accepted API keys, one per line (# comments); also read: "
                                     "$BEAR_GATEWAY_API_KEYS (comma separated)"),
    no_auth: bool = typer.Option(False, "--no-auth", help="Accept requests without a key (loopback --host only)"),
    alias: str = typer.Option("bear", "--alias", help="Model name that lets BEAR choose model and instance"),
    default_ttft_ms: float = typer.Option(1000.0, "--default-ttft-ms", min=0.001,
                                          help="TTFT target of requests without x-slo-ttft-ms / bear.ttft_ms"),
    lam: float | None = typer.Option(None, "--lambda", min=0.0,
                                     help="λ of requests without x-bear-lambda / bear.lambda (default: the router's)"),
    default_max_tokens: int | None = typer.Option(
        None, "--default-max-tokens", min=1,
        help="max_tokens of chat requests that give none; default: none, the rest of the chosen engine's context "
             "(as vLLM and OpenAI; completions: 16)"),
    max_body_bytes: int = typer.Option(1024 * 1024, "--max-body-bytes", min=1024,
                                       help="Largest request body (413 above; also bounded by NATS max_payload)"),
    body_timeout: float = typer.Option(10.0, "--body-timeout", min=0.1,
                                       help="Seconds for the whole request body to arrive (408 after)"),
    timeout: float = typer.Option(600.0, "--timeout", min=0.1, help="Seconds per request until the answer ends (504)"),
    max_inflight: int = typer.Option(4096, "--max-inflight", min=1, help="Requests in progress before 429"),
    header_timeout: float = typer.Option(
        10.0, "--header-timeout", min=0.0,
        help="Seconds for a request's line and headers to arrive, from the connection's start (kept alive: from the "
             "next request's first byte); then 408 and closed. 0: no limit (slowloris clients hold connections)"),
    max_conns_per_peer: int = typer.Option(
        512, "--max-connections-per-peer", min=0,
        help="Open connections from one client address (at most half of --max-connections); the next is answered "
             "429 and closed. Behind a proxy or "
             "load balancer every client has the proxy's address: raise it, or 0 for no cap"),
    max_connections: int | None = typer.Option(
        None, "--max-connections", min=0, show_default=False,
        help="Open connections in all; the next is answered 503 and closed. Default: the open-file limit less 256 "
             "(descriptors kept for NATS and logs); 0: no cap"),
    allowed_origins: str = typer.Option(
        "[]", "--allowed-origins",
        help='Browser origins allowed to call the gateway (CORS), a JSON list as vLLM takes it: \'["https://app.example"]\''
             ', \'["*"]\' for any; default [] (CORS off: no Access-Control-* headers, a preflight is a 405)'),
    allowed_methods: str = typer.Option('["*"]', "--allowed-methods",
                                        help="With --allowed-origins: the methods a page may use, a JSON list"),
    allowed_headers: str = typer.Option('["*"]', "--allowed-headers",
                                        help="With --allowed-origins: the request headers a page may send, a JSON list"),
    allow_credentials: bool = typer.Option(
        False, "--allow-credentials",
        help="With --allowed-origins: let pages send cookies or HTTP auth (the origin is echoed, never '*')"),
    prefix: Prefix = "bear",
    trace_exporter: TraceExporterOpt = Exporter.auto,
    otlp_endpoint: OtlpEndpoint = None,
    log_format: LogFormatOpt = LogFormat.console,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) and route every
    request through BEAR's routers over NATS; /health and /metrics for operators."""
    configure_logging(log_format, log_level)
    from bear.gateway.auth import ApiKeys, AuthConfigError
    from bear.gateway.openai_types import Defaults
    from bear.gateway.server import GatewayConfig, StartError, serve

    try:
        keys = ApiKeys.configure(api_key_file, no_auth, host)
    except AuthConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    from bear.gateway.cors import CorsPolicy

    cors = CorsPolicy.of(_json_list(allowed_origins, "--allowed-origins"), _json_list(allowed_methods, "--allowed-methods"),
                         _json_list(allowed_headers, "--allowed-headers"), allow_credentials)
    setup_tracing("bear-gateway", trace_exporter, otlp_endpoint)
    cfg = GatewayConfig(cors=cors, host=host, port=port, prefix=prefix, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout,
                        request_timeout_s=timeout, max_inflight=max_inflight, header_timeout_s=header_timeout,
                        max_conns_per_peer=max_conns_per_peer, max_connections=max_connections,
                        defaults=Defaults(alias=alias, ttft_s=default_ttft_ms / 1e3, lam=lam,
                                          max_tokens=default_max_tokens))
    try:
        aio.run(serve(nats_url, cfg, keys))
    except StartError as exc:
        typer.echo(f"bear gateway: {exc}", err=True)
        raise typer.Exit(1) from None


def _json_list(value: str, option: str) -> list[str]:
    """A JSON list of strings (vLLM's form of its CORS options); a usage error otherwise."""
    try:
        out = json.loads(value)
    except ValueError:
        out = None
    if not isinstance(out, list) or not all(isinstance(x, str) and x for x in out):
        raise typer.BadParameter(f"expects a JSON list of strings such as '[\"https://app.example\"]', got {value!r}",
                                 param_hint=option)
    return out


def bench_gateway(
    rates: str = typer.Option("50,200", "--rates", help="Comma-separated request rates (req/s, Poisson; each "
                                                        "path gets half)"),
    duration: float = typer.Option(20.0, "--duration", min=1.0, help="Seconds of load per rate"),
    max_tokens: int = typer.Option(1, "--max-tokens", min=1, help="Output tokens per request"),
    out: Path | None = typer.Option(None, "--out", help="Write the result JSON here"),
) -> None:
    """Overhead of the gateway hop: time to first byte through the gateway (HTTP, OpenAI chat
    streaming) minus through the router's NATS client, side by side in one run on a local stack."""
    from rich.console import Console

    from bear.benchmarks.gateway import print_table, run_bench

    try:
        rate_list = [float(r) for r in rates.split(",") if r.strip()]
    except ValueError:
        raise typer.BadParameter(f"--rates expects numbers separated by commas, got {rates!r}") from None
    if not rate_list or min(rate_list) <= 0:
        raise typer.BadParameter("--rates must be positive")
    res = run_bench(rate_list, duration, max_tokens=max_tokens)
    print_table(res, Console())
    if out is not None:
        out.write_text(json.dumps(json_safe(res), indent=2))


def bench_slowloris(
    connections: int = typer.Option(1100, "--connections", min=1,
                                    help="Slowloris connections, all from 127.0.0.2 (half a request's headers each, "
                                         "one more header line every --trickle s, reopened when closed)"),
    nofile: int = typer.Option(1024, "--nofile", min=64,
                               help="The gateway process's open-file limit, soft and hard (its own raise to the hard "
                                    "limit changes nothing then)"),
    duration: float = typer.Option(40.0, "--duration", min=1.0, help="Seconds of real requests during the attack"),
    rate: float = typer.Option(2.0, "--rate", min=0.1, help="Real chat requests per second from 127.0.0.1, each on "
                                                            "a new connection"),
    trickle: float = typer.Option(5.0, "--trickle", min=0.1, help="Seconds between an attack connection's header lines"),
    request_timeout: float = typer.Option(10.0, "--request-timeout", min=0.1,
                                          help="A real request not answered in this counts as failed"),
    unprotected: bool = typer.Option(True, "--unprotected/--protected-only",
                                     help="Also run the gateway with --header-timeout 0 and both connection caps off "
                                          "(as before issue 40)"),
    out: Path | None = typer.Option(None, "--out", help="Write the result JSON here"),
) -> None:
    """Slowloris against the gateway (issue 40): N half-sent requests at a low open-file limit while
    real requests come from another address; real requests served, refusals and header timeouts
    counted and logged, on a local stack."""
    from rich.console import Console

    from bear.benchmarks.gateway import print_slowloris, run_slowloris

    res = run_slowloris(connections, nofile, duration, rate, trickle, request_timeout, unprotected)
    print_slowloris(res, Console())
    if out is not None:
        out.write_text(json.dumps(json_safe(res), indent=2))


def register(app: typer.Typer) -> None:
    app.command("gateway")(gateway)


def register_bench(bench: typer.Typer) -> None:
    bench.command("gateway")(bench_gateway)
    bench.command("slowloris")(bench_slowloris)
