"""``bear sim-engine``: one simulated vLLM instance with the OpenAI API on NATS."""

from __future__ import annotations

from pathlib import Path

import typer

from bear.commands.options import (
    FIND_NATS,
    DeltasOpt,
    FullEveryOpt,
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
from bear.runtime import aio
from bear.runtime.logging import LogFormat, configure_logging
from bear.runtime.tracing import Exporter


def _check_lengths(spec: str) -> str:
    from bear.sim.lengths import OutputLengths

    try:
        OutputLengths.parse(spec)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    return spec


def sim_engine(
    profile: str = typer.Option(..., "--profile", help="Profile name (qwen3-0.6b-h100, qwen3-8b-h100, "
                                "qwen3-32b-2xh100-tp2) or path of a profile JSON file"),
    port: int = typer.Option(8000, "--port", help="HTTP port of the OpenAI-compatible API"),
    instance: str = typer.Option(..., "--instance", help="Instance id (the last token of its NATS subjects)"),
    nats_url: NatsUrl = FIND_NATS,
    nats_creds: NatsCreds = "",
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on"),
    base_url: str = typer.Option("", "--base-url", help="URL to advertise in bear_instances (default: from host/port)"),
    seed: int = typer.Option(-1, "--seed", help="Seed of the batch-time noise; -1: random"),
    heartbeat_s: float = typer.Option(0.5, "--heartbeat", help="Idle snapshot re-publication period (s)"),
    min_interval_s: float = typer.Option(0.0, "--snapshot-interval", help="Minimum seconds between snapshots; 0: every step"),
    deltas: DeltasOpt = True,
    full_every: FullEveryOpt = 256,
    output_lengths: str = typer.Option(
        "lognormal:256:0.8", "--output-lengths", callback=_check_lengths,
        help="Tokens the simulated model generates: 'max' (never EOS: max_tokens) or "
             "'lognormal:MEDIAN:SIGMA' (a seeded draw per request, capped by max_tokens)"),
    api_key_file: Path | None = typer.Option(
        None, "--api-key-file", dir_okay=False,
        help="Require Authorization: Bearer <key> on /v1/* with a key from this file (one per line), as "
             "vLLM's --api-key does; default: no key (bear up always gives one)"),
    tokenizer: str = typer.Option(
        "", "--tokenizer", help="Model directory with a tokenizer.json (and chat template): prompts are tokenised "
        "with it, the engine keeps a block-level prefix cache published on bear.kv.<id>, and the tokenizer is "
        "registered for the routers; default: none (lengths ≈ bytes / 4, no prefix cache)"),
    prefix: Prefix = "bear",
    trace_exporter: TraceExporterOpt = Exporter.auto,
    otlp_endpoint: OtlpEndpoint = None,
    log_format: LogFormatOpt = LogFormat.console,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """Run a simulated vLLM instance (roofline-timed, vLLM V1 scheduling) with the OpenAI API."""
    from bear.runtime.identity import NAME

    if not NAME.match(instance):
        raise typer.BadParameter("must be 1-128 letters, digits, '-' or '_' (it is one NATS subject token)",
                                 param_hint="--instance")
    keys = None
    if api_key_file is not None:
        from bear.gateway.auth import ApiKeys, AuthConfigError, load_keys

        try:
            keys = ApiKeys(load_keys(api_key_file, env={}))
        except AuthConfigError as exc:
            raise typer.BadParameter(str(exc), param_hint="--api-key-file") from exc
        if not len(keys):
            raise typer.BadParameter(f"no key in {api_key_file}", param_hint="--api-key-file")
    if tokenizer:
        from pathlib import Path

        if not (Path(tokenizer) / "tokenizer.json").is_file():
            raise typer.BadParameter(f"{tokenizer} has no tokenizer.json", param_hint="--tokenizer")
    configure_logging(log_format, log_level)
    setup_tracing(f"bear-sim-{instance}", trace_exporter, otlp_endpoint)
    from bear.sim.run import serve

    aio.run(serve(profile, port, instance, nats_url, host=host, prefix=prefix,
                      seed=None if seed < 0 else seed, base_url=base_url or None,
                      heartbeat_s=heartbeat_s, min_interval_s=min_interval_s, output_lengths=output_lengths,
                      api_keys=keys, tokenizer_dir=tokenizer or None, deltas=deltas, full_every=full_every))



def register(app: typer.Typer) -> None:
    app.command("sim-engine")(sim_engine)
