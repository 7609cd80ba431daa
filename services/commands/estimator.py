"""``bear estimator`` (the service), ``bear estimate`` (libbea from the shell) and the estimator's
benchmarks ``bear bench estimator``, ``estimator-service`` and ``estimator-accuracy``."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from bear.commands.options import (
    DEFAULT_METRICS_HOST,
    FIND_NATS,
    LogFormatOpt,
    LogLevel,
    LogLevelOpt,
    MetricsHost,
    NatsCreds,
    NatsUrl,
    Prefix,
)
from bear.runtime import aio
from bear.runtime.logging import LogFormat, configure_logging


def _load_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def _load_beta(coeffs: Path | None) -> list[float]:
    from bear.calibrator.fit import Fit
    from bear.protocol.messages import NOMINAL_BETA

    if coeffs is None:
        print("note: no --coeffs given; using the nominal β " + json.dumps(list(NOMINAL_BETA)), file=sys.stderr)
        return list(NOMINAL_BETA)
    raw = _load_json(coeffs)
    if isinstance(raw, list):
        raw = {"beta": raw}
    return list(Fit.from_json(raw).beta)


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def estimate(
    snapshot: Annotated[Path | None, typer.Option(help="bear.snapshot/1 JSON file of one instance.")] = None,
    request: Annotated[
        Path | None, typer.Option(help="The new query: JSON {id, prompt_tokens, max_tokens, prefix_hit_tokens}.")
    ] = None,
    lengths: Annotated[
        Path | None, typer.Option(help="JSON map request id -> predicted total output tokens of residents.")
    ] = None,
    cases: Annotated[
        Path | None, typer.Option(help="Replay cases JSONL(.gz) (format of shared/data/vllm-cpu-traces/cases).")
    ] = None,
    coeffs: Annotated[
        Path | None, typer.Option(help="β file written by `bear calibrate` ({beta: [b0..b3]}); nominal β if absent.")
    ] = None,
    trace: Annotated[bool, typer.Option("--trace", help="Also print every simulated batch {request id: tokens}.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON output (one line per case).")] = False,
) -> None:
    """Predict a query's TTFT by replaying vLLM's scheduler from a snapshot (BEA)."""
    from bear import libbea
    from bear.replay.cases import read_cases, replay_case

    beta = _load_beta(coeffs)
    if cases is not None:
        if snapshot is not None or request is not None:
            raise typer.BadParameter("use either --cases or --snapshot/--request")
        n = exact = 0
        for case in read_cases(cases):
            res = replay_case(case, beta, trace=trace)
            n += 1
            exact += bool(res.exact)
            if as_json:
                print(json.dumps(res.to_json(), separators=(",", ":")))
            else:
                line = f"{res.request}  ttft={res.ttft_s * 1e3:9.3f} ms  batches={res.n_batches}"
                if res.engine_ttft_s is not None:
                    line += f"  engine={res.engine_ttft_s * 1e3:9.3f} ms"
                if res.exact is not None:
                    line += "  exact" if res.exact else "  DIFFERS"
                print(line)
        if trace and not as_json:
            print(f"{exact}/{n} cases reproduce vLLM's batch sequence exactly", file=sys.stderr)
        return
    if snapshot is None or request is None:
        raise typer.BadParameter("--snapshot and --request are required (or --cases)")
    snap = libbea.Snapshot.from_dict(_load_json(snapshot))
    out = libbea.estimate(
        snap, _load_json(request), beta=beta, lengths=_load_json(lengths) if lengths else None, trace=trace
    )
    doc: dict[str, Any] = {"ttft_s": _finite_or_none(out["ttft_s"]), "n_batches": out["n_batches"]}
    if out["status"] != "ok":
        doc["status"] = out["status"]
    if trace:
        doc["batches"] = out["batches"]
    if as_json:
        print(json.dumps(doc, separators=(",", ":")))
    else:
        ttft = "never (" + out["status"] + ")" if doc["ttft_s"] is None else f"{out['ttft_s'] * 1e3:.3f} ms"
        print(f"TTFT {ttft} after {out['n_batches']} simulated batches")
        for k, b in enumerate(doc.get("batches", [])):
            print(f"  step {k + 1}: " + ", ".join(f"{rid}={n}" for rid, n in b.items()))


def bench_estimator(
    n: Annotated[int, typer.Option(help="Estimates per scenario for the memory check (RSS before/after).")] = 1_000_000,
    timing_reps: Annotated[int, typer.Option(help="Individually timed estimates per scenario (median, p99).")] = 20_000,
    cases: Annotated[
        Path | None, typer.Option(help="Replay cases for scenario (c); default: the shared public traces.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result table as JSON.")] = False,
    population_reps: Annotated[
        int, typer.Option(help="Timed estimates per cell of the time-vs-population table (0: skip the table).")
    ] = 2_000,
    ingest_steps: Annotated[
        int, typer.Option(help="Engine steps per population for the ingest table (full snapshots vs deltas at "
                               "64/256/1,024 residents; 0: skip it).")
    ] = 300,
    ingest_passes: Annotated[int, typer.Option(min=1, help="Passes over those steps (every step timed).")] = 3,
    nats_seconds: Annotated[
        float, typer.Option(help="Seconds per population and mode of the NATS receive measurement (a local NATS "
                                 "and one worker process; 0: skip it and count the in-process ingest only).")
    ] = 4.0,
) -> None:
    """Time per BEA estimate (median, p99) and RSS growth over many estimates, three scenarios; then
    estimate time vs population (64/256/1,024 running x 0/64/256/512 waiting); then ingest per
    engine step (full snapshots vs deltas: CPU, bytes, ingest + estimate) and a worker's capacity."""
    from bear.benchmarks.estimator import run_bench

    run_bench(n=n, timing_reps=timing_reps, cases_path=cases, as_json=as_json, population_reps=population_reps,
              ingest_steps=ingest_steps, ingest_passes=ingest_passes, nats_seconds=nats_seconds)


def estimator(
    nats_url: NatsUrl = FIND_NATS,
    nats_creds: NatsCreds = "",
    workers: int = typer.Option(1, "--workers", min=1, help="Worker processes to start (they share only NATS); "
                                "with --nats-creds 'DIR/estimator-{worker}.json' each connects as its own identity "
                                "(bear nats config --service-replicas estimator=N)"),
    max_age_s: float = typer.Option(1.0, "--max-age", help="Snapshots older than this (s) use the analytic fallback"),
    down_after_s: float = typer.Option(
        10.0, "--down-after", help="No snapshot and no registry heartbeat for this long (s): instance is down"
    ),
    default_output_tokens: int = typer.Option(
        256, "--default-output-tokens", help="Predicted total output tokens of residents never announced on dispatch"
    ),
    overrun_fraction: float = typer.Option(
        0.5, "--overrun-fraction", help="A resident past its prediction gets this fraction of it again"
    ),
    compensate_staleness: bool = typer.Option(
        True, "--compensate-staleness/--no-compensate-staleness",
        help="Run residents through each snapshot's age before inserting the query (assumes NTP-synchronised "
             "clocks between instances and workers)"
    ),
    length_draws: int = typer.Option(
        15, "--length-draws", min=0, max=1025,
        help="Replays per estimate with the residents' output lengths drawn around their predictions (the "
             "calibration's spread); the estimate is their median TTFT. 0: one replay with the predicted lengths "
             "(cheaper: docs/estimator.md, \"Output lengths drawn\", has the cost)"),
    prefix_hits: bool = typer.Option(
        True, "--prefix-hits/--no-prefix-hits",
        help="Mirror the instances' prefix caches (bear.kv.*) and give each query's hit to the replay; "
             "--no-prefix-hits: every prompt is estimated as if nothing of it were cached"),
    with_calibrator: bool = typer.Option(
        False, "--with-calibrator", help="Also run the online β calibrator in this process (single worker only)"
    ),
    shards: int = typer.Option(1, "--shards", min=1, help="Estimator shards of the deployment (the routers' "
                               "--estimator-shards); 1: every worker serves every instance"),
    shard: int = typer.Option(0, "--shard", min=0, help="The shard these workers serve, 0 … shards − 1: they follow "
                              "only the registered instances whose id hashes to it"),
    prefix: Prefix = "bear",
    metrics_port: int = typer.Option(0, "--metrics-port", min=0, max=65535,
                                     help="Prometheus port (worker i uses port+i); 0: off"),
    metrics_host: MetricsHost = DEFAULT_METRICS_HOST,
    log_format: LogFormatOpt = LogFormat.console,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """Serve bear.estimate: BEA TTFT per candidate instance from the newest snapshots."""
    if shard >= shards:
        raise typer.BadParameter(f"--shard {shard} must be below --shards {shards}")
    if workers > 1:
        from bear.estimator.service import run_forked

        argv = ["--nats", nats_url, "--max-age", str(max_age_s), "--down-after", str(down_after_s),
                "--default-output-tokens", str(default_output_tokens), "--overrun-fraction", str(overrun_fraction),
                "--prefix", prefix, "--log-format", str(log_format), "--log-level", log_level,
                "--shards", str(shards), "--shard", str(shard), "--metrics-host", metrics_host,
                "--length-draws", str(length_draws)]
        argv.append("--compensate-staleness" if compensate_staleness else "--no-compensate-staleness")
        argv.append("--prefix-hits" if prefix_hits else "--no-prefix-hits")
        raise typer.Exit(run_forked(argv, workers, metrics_port or None))
    configure_logging(log_format, log_level)
    from bear.estimator.estimate import EstimatorConfig
    from bear.estimator.service import WORKER_FIELD, run_worker, worker_creds
    from bear.runtime.identity import CREDS_ENV

    if WORKER_FIELD in os.environ.get(CREDS_ENV, ""):  # one worker of a template: the first identity
        os.environ[CREDS_ENV] = worker_creds(os.environ[CREDS_ENV], 0)
    from bear.runtime.metrics import start_metrics_server

    start_metrics_server(metrics_port, metrics_host)
    cfg = EstimatorConfig(max_age_s=max_age_s, down_after_s=down_after_s, default_output_tokens=default_output_tokens,
                          overrun_fraction=overrun_fraction, compensate_staleness=compensate_staleness,
                          use_prefix_hits=prefix_hits, length_draws=length_draws,
                          shards=shards, shard=shard)
    aio.run(run_worker(nats_url, cfg, prefix, with_calibrator))



def bench_estimator_service(
    nats_url: str = typer.Option("", "--nats", help="Use this NATS and its running workers; "
                                 "default: start a local NATS and one worker process"),
    seconds: float = typer.Option(5.0, "--seconds", help="Measurement duration"),
    concurrency: int = typer.Option(32, "--concurrency", min=1, help="Requests in flight"),
    instances: int = typer.Option(3, "--instances", min=1, help="Candidate instances per query"),
    residents: int = typer.Option(64, "--residents", min=0, help="Resident requests per instance snapshot"),
    clients: int = typer.Option(2, "--clients", min=1, help="Client processes generating load"),
    latency_seconds: float = typer.Option(2.0, "--latency-seconds", help="Unloaded-latency phase (one in flight)"),
    length_draws: int | None = typer.Option(None, "--length-draws", min=0, max=1025,
                                            help="The started worker's --length-draws (0: point lengths only; "
                                                 "default: the worker's own); not with --nats"),
    log_format: LogFormatOpt = LogFormat.console,
) -> None:
    """Measure estimate throughput and service time of one worker process over NATS."""
    if nats_url and length_draws is not None:
        raise typer.BadParameter("--length-draws applies to the worker this command starts, not to those of --nats",
                                 param_hint="--length-draws")
    configure_logging(log_format, "warning")
    from bear.benchmarks.estimator_service import run_bench

    res = run_bench(nats_url or None, seconds=seconds, concurrency=concurrency, n_instances=instances,
                    residents=residents, clients=clients,
                    latency_seconds=latency_seconds, length_draws=length_draws)
    from rich import print as rprint

    rprint(res)



def bench_estimator_accuracy(
    profile: str = typer.Option("qwen3-8b-h100", "--profile", help="Sim profile name or file"),
    qps: float = typer.Option(4.0, "--qps", help="Poisson arrival rate (queries/s)"),
    seconds: float = typer.Option(15.0, "--seconds", help="Measured duration after the warm-up"),
    warmup_s: float = typer.Option(4.0, "--warmup", help="Warm-up (first calibration) not measured"),
    length_noise: float = typer.Option(0.3, "--length-noise", help="σ of the log-normal error of predicted lengths"),
    compensate: bool = typer.Option(False, "--compensate", help="Use staleness compensation"),
    seed: int = typer.Option(0, "--seed", help="Workload and noise seed"),
    nats_url: str = typer.Option("", "--nats", help="NATS URL; default: start a local one"),
) -> None:
    """BEA's TTFT MAPE against the TTFTs a simulated instance actually produced under load."""
    configure_logging(LogFormat.console, "warning")
    from rich import print as rprint

    from bear.benchmarks.estimator_accuracy import run

    rprint(run(nats_url or None, profile=profile, qps=qps, seconds=seconds, warmup_s=warmup_s, seed=seed,
               length_noise=length_noise, compensate=compensate))


def register(app: typer.Typer) -> None:
    app.command("estimator")(estimator)
    app.command("estimate")(estimate)


def register_bench(bench: typer.Typer) -> None:
    bench.command("estimator")(bench_estimator)
    bench.command("estimator-service")(bench_estimator_service)
    bench.command("estimator-accuracy")(bench_estimator_accuracy)
