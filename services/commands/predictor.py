"""CLI: ``bear predictor`` (the service), ``bear predictor train``, ``bear bench predictor`` and
``bear data synth``. Heavy imports stay inside the command functions so ``bear --help`` is fast."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import structlog
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
from bear.runtime.logging import LogFormat, configure_logging

log = structlog.get_logger(__name__)

predictor_app = typer.Typer(
    help="Per-model accuracy / output length / cost predictor: run the bear.predict service "
    "(no subcommand), train it, benchmark it.",
    invoke_without_command=True,
    no_args_is_help=False,
)
data_app = typer.Typer(help="Datasets for the predictor.", no_args_is_help=True)



@predictor_app.callback()
def predictor_service(
    ctx: typer.Context,
    nats_url: NatsUrl = FIND_NATS,
    nats_creds: NatsCreds = "",
    model_dir: Path | None = typer.Option(None, "--model-dir", help="Directory written by `bear predictor train`."),
    tokenizer_dir: Path | None = typer.Option(
        None, "--tokenizer-dir", help="Folder with <model>/tokenizer.json files (else the HF cache, else fallback)."
    ),
    prefix: Prefix = "bear",
    workers: int = typer.Option(2, "--workers", min=1, help="Threads for long prompts."),
    max_inflight: int = typer.Option(256, "--max-inflight", min=1, help="Requests in progress before 'overloaded'."),
    inline_max_bytes: int = typer.Option(
        64 * 1024, "--inline-max-bytes", min=0,
        help="Requests up to this size (msgpack bytes) are predicted on the event loop, larger ones in the pool."
    ),
    max_prompt_bytes: int = typer.Option(512 * 1024, "--max-prompt-bytes", min=1, help="Larger prompts get 'too_large'."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", min=1, max=65535,
                                            help="Serve Prometheus metrics on this port."),
    metrics_host: MetricsHost = DEFAULT_METRICS_HOST,
    log_format: LogFormatOpt = LogFormat.console,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """Run the bear.predict service (queue group: start more processes to scale)."""
    if ctx.invoked_subcommand is not None:
        return
    configure_logging(log_format, log_level)
    if model_dir is None:
        raise typer.BadParameter("--model-dir is required to run the service", param_hint="--model-dir")
    from bear.predictor.runtime import Predictor
    from bear.predictor.service import ServiceLimits, serve
    from bear.runtime import aio

    predictor = Predictor(model_dir, tokenizer_dir)
    log.info("predictor_loaded", native_forest=predictor.forest is not None, event_loop=aio.loop_name())
    limits = ServiceLimits(max_prompt_bytes=max_prompt_bytes, max_inflight=max_inflight,
                           inline_max_bytes=inline_max_bytes, workers=workers)
    aio.run(serve(nats_url, predictor, limits, prefix, metrics_port, metrics_host=metrics_host))


def _progress_bar() -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


@predictor_app.command("train")
def train_cmd(
    data: Path = typer.Option(..., "--data", exists=True, dir_okay=False, help="Dataset (JSONL[.gz] or Parquet)."),
    out: Path = typer.Option(..., "--out", help="Model directory to write (heads, meta.json, report)."),
    models: Path | None = typer.Option(None, "--models", help="JSON list of model specs (default: paper Table 1)."),
    rounds: int = typer.Option(150, "--rounds", min=1, help="Boosting rounds per head."),
    learning_rate: float = typer.Option(0.1, "--learning-rate", help="LightGBM learning rate."),
    num_leaves: int = typer.Option(15, "--num-leaves", min=2, help="LightGBM leaves per tree."),
    test_fraction: float = typer.Option(0.2, "--test-fraction", min=0.0, max=0.9, help="Queries held out for the report."),
    seed: int = typer.Option(0, "--seed", help="Seed of the split and of LightGBM."),
    threads: int = typer.Option(1, "--threads", min=1, help="LightGBM training threads (1 is fastest on a busy host)."),
    log_format: LogFormatOpt = LogFormat.console,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """Train the quality and output-length heads, then evaluate them on held-out queries."""
    configure_logging(log_format, log_level)
    from rich.console import Console

    from bear.predictor.dataset import read_records
    from bear.predictor.evaluate import evaluate, plot
    from bear.predictor.models import load_models
    from bear.predictor.runtime import Predictor
    from bear.predictor.train import TrainConfig, train

    records = read_records(data)
    log.info("dataset_loaded", path=str(data), records=len(records))
    cfg = TrainConfig(rounds=rounds, learning_rate=learning_rate, num_leaves=num_leaves,
                      test_fraction=test_fraction, seed=seed, threads=threads)
    with _progress_bar() as bar:
        ids: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in ids:
                ids[stage] = bar.add_task(stage, total=total)
            bar.update(ids[stage], completed=done)

        _, m_test = train(records, out, load_models(models), cfg, progress)
    if len(m_test.quality) == 0:
        log.warning("no_test_records", hint="use --test-fraction > 0 for a report")
        return
    predictor = Predictor(out)
    report = evaluate(predictor, m_test)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plot(predictor, m_test, out / "report.png")
    _print_report(Console(), report)
    log.info("trained", out=str(out), report=str(out / "report.json"), plot=str(out / "report.png"))


def _print_report(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="held-out evaluation")
    for col in ["task/model", "n", "acc MAE", "acc R²", "acc true/pred", "len MAE", "len R²", "≤p50", "≤p90"]:
        table.add_column(col, justify="right")
    rows = [*report["by_task_model"].items(), ("overall", report["overall"])]
    for name, m in rows:
        table.add_row(name, str(m["n"]), f"{m['acc_mae']:.3f}", f"{m['acc_r2']:.2f}",
                      f"{m['acc_mean_true']:.3f}/{m['acc_mean_pred']:.3f}", f"{m['len_mae']:.0f}",
                      f"{m['len_r2']:.2f}", f"{m['cover_p50']:.2f}", f"{m['cover_p90']:.2f}")
    console.print(table)
    for task, r in report["ranking"].items():
        console.print(f"{task}: true ranking {r['true']}, predicted {r['pred']} → {'ok' if r['match'] else 'MISMATCH'}")


async def _wait_service(url: str, within_s: float) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            try:
                await nc.request("$SRV.PING.bear-predictor", b"", timeout=0.5)
                return
            except Exception:
                await asyncio.sleep(0.2)
        raise TimeoutError("predictor service did not come up")
    finally:
        await nc.close()


def bench_predictor(
    model_dir: Path = typer.Option(..., "--model-dir", exists=True, file_okay=False, help="Trained model directory."),
    nats_url: str | None = typer.Option(None, "--nats", help="NATS URL (default: start a local nats-server)."),
    spawn: bool = typer.Option(True, "--spawn/--no-spawn", help="Start one predictor process for the run."),
    n: int = typer.Option(3000, "--n", min=10, help="Requests per phase."),
    concurrency: int = typer.Option(32, "--concurrency", min=1, help="Requests in flight in the throughput phase."),
    queries: int = typer.Option(400, "--queries", min=4, help="Distinct synthetic prompts cycled through."),
    out: Path | None = typer.Option(None, "--out", help="Write the results as JSON here."),
    log_format: LogFormatOpt = LogFormat.console,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """Latency (p50/p99, one request at a time) and throughput of bear.predict with 3 candidates."""
    configure_logging(log_format, log_level)
    from rich.console import Console
    from rich.table import Table

    from bear.benchmarks.predictor import run_bench
    from bear.predictor.runtime import Predictor
    from bear.predictor.synth import generate
    from bear.runtime import aio
    from bear.runtime.nats_server import LocalNatsServer

    models = Predictor(model_dir).models[:3]
    # Prompts only: the synthetic generator needs one of its own model names to emit records.
    prompts = [(r.prompt, r.task) for r in generate(queries, seed=12345, models=("Qwen3-8B",))]
    server = None
    proc = None
    try:
        if nats_url is None:
            server = LocalNatsServer().start()
            nats_url = server.url
        if spawn:
            proc = subprocess.Popen(
                [sys.executable, "-m", "bear", "predictor", "--nats", nats_url, "--model-dir", str(model_dir),
                 "--log-level", "warning"],
                env={**os.environ},
            )
        asyncio.run(_wait_service(nats_url, 30.0))
        # The client runs on the loop BEAR processes use (uvloop unless BEAR_EVENT_LOOP=asyncio),
        # as the router, bear.predict's real client, does.
        seq, par = aio.run(run_bench(nats_url, prompts, models, n, n, concurrency))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        if server is not None:
            server.close()
    load = os.getloadavg()
    table = Table(title=f"bear.predict, {len(models)} candidate models, {len(prompts)} synthetic prompts, "
                  f"{os.cpu_count()} CPUs, load average {load[0]:.1f}, client loop {aio.loop_name()}")
    for col in ["phase", "n", "p50 ms", "p99 ms", "mean ms", "req/s", "errors", "p50 ms by task"]:
        table.add_column(col)
    for name, r in (("sequential", seq), (f"{concurrency} in flight", par)):
        table.add_row(name, str(r.n), f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}", f"{r.mean_ms:.3f}",
                      f"{r.throughput_rps:.0f}", str(r.errors),
                      ", ".join(f"{k} {v:.2f}" for k, v in r.per_task_p50_ms.items()))
    Console().print(table)
    if out is not None:
        host = {"cpus": os.cpu_count(), "load_average_1m": load[0], "client_loop": aio.loop_name()}
        out.write_text(json.dumps({"sequential": seq.to_dict(), "throughput": par.to_dict(), "host": host}, indent=2))


@data_app.command("synth")
def synth_cmd(
    out: Path = typer.Option(..., "--out", help="JSONL file to write (.gz to compress)."),
    queries: int = typer.Option(2000, "--queries", min=1, help="Number of queries (one record per model each)."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    log_format: LogFormatOpt = LogFormat.console,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """Write a SYNTHETIC dataset (four task families, Table 2 quality levels) — not real evaluations."""
    configure_logging(log_format, log_level)
    from bear.predictor.dataset import write_records
    from bear.predictor.synth import generate

    with _progress_bar() as bar:
        task = bar.add_task("queries", total=queries)

        def records() -> Any:
            last = None
            for r in generate(queries, seed=seed):
                if r.query_id != last:
                    bar.advance(task)
                    last = r.query_id
                yield r

        n = write_records(out, records())
    log.info("synthetic_dataset_written", path=str(out), records=n, queries=queries, synthetic=True)


def register(app: typer.Typer) -> None:
    app.add_typer(predictor_app, name="predictor")
    app.add_typer(data_app, name="data")


def register_bench(bench: typer.Typer) -> None:
    bench.command("predictor")(bench_predictor)
