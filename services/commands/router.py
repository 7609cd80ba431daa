"""``bear router``: the routing service. Heavy imports stay inside the command function."""

from __future__ import annotations

from pathlib import Path

import typer

from bear.commands.options import (
    DEFAULT_METRICS_HOST,
    FIND_NATS,
    LogFormatOpt,
    LogLevel,
    LogLevelOpt,
    MetricsHost,
    MetricsPort,
    NatsCreds,
    NatsUrl,
    OtlpEndpoint,
    PolicyName,
    PolicyOpt,
    PolicyParamsOpt,
    Prefix,
    TraceExporterOpt,
    policy_params,
    setup_tracing,
)
from bear.runtime import aio
from bear.runtime.logging import LogFormat, configure_logging
from bear.runtime.tracing import Exporter


def _aliases(raw: list[str]) -> dict[str, str]:
    out = {}
    for item in raw:
        k, _, v = item.partition("=")
        if not v:
            raise typer.BadParameter(f"--model-alias expects SERVED=PREDICTOR, got {item!r}")
        out[k.strip()] = v.strip()
    return out


def _engine_keys(path: Path | None) -> dict[str, str]:
    if path is None:
        return {}
    import json

    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint="--engine-keys") from exc
    if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in d.items()):
        raise typer.BadParameter(f"{path} must map instance ids to keys (strings)", param_hint="--engine-keys")
    return d


def _per_identity(raw: list[str], option: str, cast: type, low: float) -> dict[str, float]:
    """``IDENTITY=VALUE`` items (``*``: every identity without its own) as a dict, each value
    ``cast`` and at least ``low``."""
    out: dict[str, float] = {}
    for item in raw:
        k, sep, v = item.rpartition("=")
        try:
            val = cast(v)
        except ValueError:
            val = None
        if not sep or not k.strip() or val is None or not val >= low or val != val:
            raise typer.BadParameter(f"expected IDENTITY=VALUE with VALUE {'an integer' if cast is int else 'a number'} "
                                     f"≥ {low:g}, got {item!r}", param_hint=option)
        out[k.strip()] = val
    return out


def _base_urls(raw: list[str]) -> list[str]:
    import ipaddress
    from urllib.parse import urlsplit

    for u in raw:
        if "://" not in u:
            try:
                ipaddress.ip_network(u, strict=False)
                continue
            except ValueError:
                pass
        parts = urlsplit(u)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise typer.BadParameter(f"expected http(s)://HOST[:PORT][/PATH] or a network (10.0.0.0/8), got {u!r}",
                                     param_hint="--allow-base-url")
    return raw


def router(
    nats_url: NatsUrl = FIND_NATS,
    nats_creds: NatsCreds = "",
    policy: PolicyOpt = PolicyName.bear,
    param: PolicyParamsOpt = [],  # noqa: B006 (typer reads the default)
    lam: float = typer.Option(5e-4, "--lambda", help="Default λ of U = acc − λ·cost (cost in micro-USD)"),
    predict_budget: float = typer.Option(0.2, "--predict-budget", help="Seconds the predictor may take (2 tries)"),
    estimate_budget: float = typer.Option(0.2, "--estimate-budget", help="Seconds the estimator may take (2 tries)"),
    default_output_tokens: int = typer.Option(
        256, "--default-output-tokens", help="Output length assumed when the predictor does not answer"),
    max_inflight: int = typer.Option(4096, "--max-inflight", min=1,
                                     help="Queries in progress (answers streaming included) before `overloaded`"),
    max_deciding: int = typer.Option(256, "--max-deciding", min=1,
                                     help="Queries being decided (not yet dispatched) before `overloaded`"),
    shed_lag: float = typer.Option(1.0, "--shed-lag", min=0.001,
                                   help="Event-loop lag (s) beyond which new submits are refused `overloaded`"),
    identity_weight: list[str] = typer.Option(
        [], "--identity-weight",
        help="IDENTITY=W: the weight of a client identity in the fair shares of a busy router (W > 0, default 1; "
             "IDENTITY: a NATS client identity, gateway/<key-tag> for a gateway API key, * for every other); "
             "repeatable. Under pressure an identity holding more than W/ΣW of the queries in progress is refused "
             "first (docs/router.md, 'Fair shares')"),
    identity_limit: list[str] = typer.Option(
        [], "--identity-limit",
        help="IDENTITY=N: at most N queries of that identity in progress here, whatever the load (N ≥ 0; 0: no "
             "limit; * for every identity without its own); repeatable"),
    fair_relay: list[str] = typer.Option(
        ["gateway"], "--fair-relay",
        help="A client identity that relays others' queries and names their tenant in a Bear-Tenant header, "
             "each tenant then its own identity <relay>/<tenant> (default: gateway; repeatable)"),
    first_token_timeout: float = typer.Option(
        25.0, "--first-token-timeout", min=0.001,
        help="Seconds after dispatch without a first token before the engine request is aborted and the "
             "client gets `deadline_exceeded` (below the client library's 30 s silence limit)"),
    engine_keys: Path | None = typer.Option(
        None, "--engine-keys", dir_okay=False,
        help="JSON file {instance id (or \"*\"): API key} of the engines; sent as Authorization: Bearer "
             "(bear up writes one per run)"),
    allow_base_url: list[str] = typer.Option(
        [], "--allow-base-url", help="Route only to instances whose registered base URL is under this one "
                                     "(scheme, host, optional port and path) or whose host is an address in this "
                                     "network (e.g. 10.0.0.0/8); repeatable; default: any"),
    provisioning: bool = typer.Option(
        False, "--provisioning/--no-provisioning",
        help="Take only registry entries that agree with the instance's binding in the bear_provisioned bucket "
             "(model, base URL, prices; written by admin: bear up, bear nats provision --instances) and send engine "
             "keys only to the provisioned base URL (bear up turns it on with authentication)"),
    estimator_shards: int = typer.Option(1, "--estimator-shards", min=1,
                                         help="Estimator shards of the deployment (the workers' --shards)"),
    down_after: float = typer.Option(10.0, "--down-after", help="Registry heartbeat older than this (s): down"),
    model_alias: list[str] = typer.Option(
        [], "--model-alias", help="SERVED=PREDICTOR model name mapping (default: last path part); repeatable"),
    outcome_log: Path | None = typer.Option(None, "--outcome-log", help="JSONL file of every query's record"),
    tokenize: bool = typer.Option(
        True, "--tokenize/--no-tokenize",
        help="Tokenise each query with the tokenizers the instances register (exact prompt lengths, prefix-cache "
             "hits); --no-tokenize: lengths estimated from the text (bytes / 4), no hits"),
    prime_answers: bool = typer.Option(
        True, "--prime-answers/--no-prime-answers",
        help="After each answer, encode the conversation with it in the background, so that the next turn, "
             "which resends it, encodes only its new message; --no-prime-answers: each turn encodes the last "
             "answer when it arrives"),
    coalesce: bool = typer.Option(
        True, "--coalesce/--no-coalesce",
        help="Relay the answer's chunks that arrived from the engine in one read as one message to the client "
             "(nothing waits for more); --no-coalesce: one message per engine chunk"),
    sequence: bool = typer.Option(
        True, "--sequence/--no-sequence",
        help="Decide queries one at a time, in order, each on estimates that include every dispatch this router "
             "made before it (a burst spreads instead of herding onto one instance: docs/router.md, 'Decisions "
             "in order'); --no-sequence: each query on its own estimate, blind to decisions made beside it"),
    sequence_chain: int = typer.Option(
        8, "--sequence-chain", min=0, max=64,
        help="Waiting queries a fresh estimate at the chosen instance covers too (0-64; 0: one query per ask)"),
    reserve: float = typer.Option(
        0.25, "--reserve", min=0.0, max=10.0,
        help="Seconds each of this router's dispatches is sent with its estimates, in case the estimator has "
             "not heard it yet (0-10)"),
    metrics_port: MetricsPort = 0,
    metrics_host: MetricsHost = DEFAULT_METRICS_HOST,
    prefix: Prefix = "bear",
    trace_exporter: TraceExporterOpt = Exporter.auto,
    otlp_endpoint: OtlpEndpoint = None,
    log_format: LogFormatOpt = LogFormat.console,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """Route queries from bear.submit: predictor + estimator → policy → instance, streaming back."""
    from bear.tokenizer.chunks import encode_on_calling_thread

    encode_on_calling_thread()
    configure_logging(log_format, log_level)
    setup_tracing("bear-router", trace_exporter, otlp_endpoint)
    from bear.router.config import RouterConfig
    from bear.router.service import serve
    from bear.runtime.metrics import start_metrics_server

    weights = _per_identity(identity_weight, "--identity-weight", float, 1e-9)
    limits = {k: int(v) for k, v in _per_identity(identity_limit, "--identity-limit", int, 0).items()}
    default_limit = limits.pop("*", 0)
    default_weight = weights.pop("*", 1.0)
    cfg = RouterConfig(policy=str(policy), policy_params=policy_params(str(policy), param), lam=lam, predict_budget_s=predict_budget,
                       predict_try_s=predict_budget / 2, estimate_budget_s=estimate_budget,
                       estimate_try_s=estimate_budget / 2, default_output_tokens=default_output_tokens,
                       max_inflight=max_inflight, max_deciding=max_deciding, shed_lag_s=shed_lag,
                       first_token_timeout_s=first_token_timeout, down_after_s=down_after, outcome_log=outcome_log, estimator_shards=estimator_shards,
                       tokenize=tokenize, prime_answers=prime_answers, coalesce=coalesce, aliases=_aliases(model_alias), engine_keys=_engine_keys(engine_keys),
                       allowed_base_urls=tuple(_base_urls(allow_base_url)), provisioning=provisioning,
                       sequence=sequence, sequence_chain=sequence_chain, reserve_s=reserve,
                       identity_weights=weights, identity_limits=limits, identity_limit=default_limit,
                       identity_weight=default_weight, fair_relays=tuple(fair_relay))
    start_metrics_server(metrics_port, metrics_host)
    aio.run(serve(nats_url, cfg, prefix))



def register(app: typer.Typer) -> None:
    app.command("router")(router)
