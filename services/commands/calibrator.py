"""``bear calibrator`` (online β per instance from NATS) and ``bear calibrate`` (β from files)."""

from __future__ import annotations

import json
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
    MetricsPort,
    NatsCreds,
    NatsUrl,
    Prefix,
)
from bear.runtime import aio
from bear.runtime.logging import LogFormat, configure_logging


def _check_objective(value: str) -> str:
    from bear.calibrator.fit import OBJECTIVES

    if value not in OBJECTIVES:
        raise typer.BadParameter(f"{value!r} is not one of: {', '.join(OBJECTIVES)}")
    return value


def calibrator(
    nats_url: NatsUrl = FIND_NATS,
    nats_creds: NatsCreds = "",
    window: int = typer.Option(2000, "--window", min=10, help="Batch records kept per instance (sliding window)"),
    min_records: int = typer.Option(50, "--min-records", min=4, help="Records needed before the first fit"),
    refit_s: float = typer.Option(5.0, "--refit-every", help="Seconds between refits"),
    objective: str = typer.Option("absolute", "--objective", callback=_check_objective,
                                  help="What the fit minimises: absolute (default), sqrt or relative"),
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
    aio.run(run_calibrator(nats_url, prefix, window=window, min_records=min_records, refit_s=refit_s,
                          objective=objective))



def calibrate(
    batches: Annotated[
        list[Path], typer.Option("--batches", help="bear.batch/1 JSONL(.gz) file(s); repeat or list several.")
    ],
    out: Annotated[Path, typer.Option(help="Where to write {beta, mape, n} as JSON.")],
    extra: Annotated[list[Path] | None, typer.Argument(help="More batch files.", show_default=False)] = None,
    objective: Annotated[str, typer.Option(
        help="What the fit minimises: absolute (least squares on durations: unbiased sums, the default), "
             "sqrt (weights 1/√duration) or relative (batch-time MAPE).", callback=_check_objective)] = "absolute",
    cases: Annotated[Path | None, typer.Option(
        help="Replay cases JSONL(.gz) (engine TTFTs): also report the TTFT error of the fit, and of every "
             "objective side by side.")] = None,
) -> None:
    """Fit the batch-time model — eq. 12's β0..β3 by non-negative least squares, or a roofline of
    two eq. 12 lines where one line cannot follow the batches (the online calibrator's choice) —
    and report its batch-time MAPE and, with --cases, the TTFT MAPE of BEA with it, beside eq. 12
    under every objective."""
    from bear.calibrator.fit import OBJECTIVES, design_matrix, fit_arrays, fit_roofline, read_records

    files = list(batches) + list(extra or [])
    x, y = design_matrix(read_records(files))
    fits = {name: fit_arrays(x, y, name) for name in OBJECTIVES}
    cal = fit_roofline(x, y, objective)
    fits[f"{objective}+roofline"] = cal
    out.write_text(json.dumps({**cal.to_json(), "objective": objective}, indent=2) + "\n")
    what = "a roofline: β then γ" if cal.gamma is not None else "eq. 12"
    print(f"β = [{', '.join(f'{b:.4g}' for b in cal.coefficients)}]  ({objective}, {what})  batch-time MAPE "
          f"{cal.mape * 100:.1f}% over {cal.n} batches -> {out}")
    if cases is None:
        return
    from bear.replay.cases import read_cases, ttft_errors

    rows = list(read_cases(cases))
    print(f"{'objective':<19} {'batch MAPE':>10} {'TTFT MAPE':>10} {'TTFT median error':>18}   ({len(rows)} cases)")
    for name, f in fits.items():
        m, bias, _ = ttft_errors(rows, f.coefficients)
        mark = "  <- written" if f is cal else ""
        print(f"{name:<19} {f.mape * 100:>9.1f}% {m * 100:>9.1f}% {bias * 100:>+17.1f}%{mark}")


def print_decomposition(table: dict[str, dict[str, Any]]) -> None:
    """The per-instance table of ``bear.calibrator.live_error.decompose`` (ms and %)."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.2f}"

    print(f"{'instance':<14} {'n':>5} {'MAPE':>7} {'median':>7} {'observed':>9} {'elapsed':>8} {'engine':>8} "
          f"{'path':>7} {'left':>7} {'resid p10/p50/p90 ms':>22} {'fit a ms':>9} {'b µs/tok':>9} "
          f"{'MAPE+fit':>9} {'median+fit':>10}")
    for inst, r in table.items():
        b = r["path_fit_b_s_per_token"]
        print(f"{inst:<14} {r['n']:>5} {r['mape_pct']:>6.1f}% {r['median_signed_pct']:>+6.1f}% "
              f"{ms(r['observed_s']):>9} {ms(r['elapsed_s']):>8} {ms(r['engine_s']):>8} {ms(r['path_s']):>7} "
              f"{ms(r['left_s']):>7} {ms(r['residual_p10_s']):>6}/{ms(r['residual_p50_s'])}/{ms(r['residual_p90_s'])}"
              f" {ms(r['path_fit_a_s']):>9} {'-' if b is None else f'{b * 1e6:.3f}':>9} "
              f"{r['mape_with_fit_pct']:>8.1f}% {r['median_signed_with_fit_pct']:>+9.1f}%")


def diagnose_live(
    log: Annotated[Path, typer.Argument(help="A router's outcome log (JSONL: bear router --outcome-log).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the table as JSON.")] = False,
) -> None:
    """The live TTFT error by source: per instance, the observed TTFT as the router's time before
    the estimate + the estimate's engine part + the path term + what is left; the residual outside
    the replay and the path model the calibrator would fit from it (docs/cli.md)."""
    from bear.calibrator.live_error import decompose, read_log

    table = decompose(read_log(log))
    if as_json:
        print(json.dumps(table, indent=2))
    else:
        print_decomposition(table)


def register(app: typer.Typer) -> None:
    app.command("calibrator")(calibrator)
    app.command("calibrate")(calibrate)
    app.command("diagnose-live")(diagnose_live)
