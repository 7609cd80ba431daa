"""``bear calibrator`` (online β per instance from NATS) and ``bear calibrate`` (β from files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from bear.options import (
    DEFAULT_METRICS_HOST,
    FIND_NATS,
    LogFormatOpt,
    LogLevel,
    LogLevelOpt,
    MetricsHost,
    MetricsPort,
    NatsUrl,
    Prefix,
)
from bear.runtime import aio
from bear.runtime.logging import LogFormat, configure_logging


def calibrator(
    nats_url: NatsUrl = FIND_NATS,
    window: int = typer.Option(2000, "--window", min=10, help="Batch records kept per instance (sliding window)"),
    min_records: int = typer.Option(50, "--min-records", min=4, help="Records needed before the first fit"),
    refit_s: float = typer.Option(5.0, "--refit-every", help="Seconds between refits"),
    prefix: Prefix = "bear",
    metrics_port: MetricsPort = 0,
    metrics_host: MetricsHost = DEFAULT_METRICS_HOST,
    log_format: LogFormatOpt = LogFormat.console,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """Fit β per instance online from bear.batches.* and publish it to bear_calibration."""
    configure_logging(log_format, log_level)
    from bear.calibrator.service import run_calibrator
    from bear.runtime.metrics import start_metrics_server

    start_metrics_server(metrics_port, metrics_host)
    aio.run(run_calibrator(nats_url, prefix, window=window, min_records=min_records, refit_s=refit_s))



def calibrate(
    batches: Annotated[
        list[Path], typer.Option("--batches", help="bear.batch/1 JSONL(.gz) file(s); repeat or list several.")
    ],
    out: Annotated[Path, typer.Option(help="Where to write {beta, mape, n} as JSON.")],
    extra: Annotated[list[Path] | None, typer.Argument(help="More batch files.", show_default=False)] = None,
) -> None:
    """Fit eq. 12's β0..β3 by non-negative least squares and report the batch-time MAPE."""
    from bear.calibrator.fit import fit_beta, read_records

    files = list(batches) + list(extra or [])
    cal = fit_beta(read_records(files))
    out.write_text(json.dumps(cal.to_json(), indent=2) + "\n")
    print(
        f"β = [{', '.join(f'{b:.4g}' for b in cal.beta)}]  batch-time MAPE {cal.mape * 100:.1f}% "
        f"over {cal.n} batches -> {out}"
    )


def register(app: typer.Typer) -> None:
    app.command("calibrator")(calibrator)
    app.command("calibrate")(calibrate)
