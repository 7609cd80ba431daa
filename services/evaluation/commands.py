"""``bear eval``: run one of the paper's experiments and write its JSON result and PNG plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from bear.options import policy_list, positive, positive_list
from bear.protocol.codec import json_safe

EXPERIMENTS = ["rates", "delta", "bursty", "staleness", "estimator", "lambda", "accuracy", "prefix"]


def eval_cmd(
    experiment: Annotated[str, typer.Option(help=f"Which experiment: {', '.join(EXPERIMENTS)}.")] = "rates",
    seed: Annotated[int, typer.Option(help="Seed of queries, arrivals, targets and engine noise.")] = 0,
    n_queries: Annotated[int, typer.Option(min=1, help="Queries per simulated run.")] = 2000,
    rates: Annotated[
        str | None, typer.Option(callback=positive_list,
                                 help="Comma-separated arrival rates (q/s) for rates/estimator/prefix; default: the paper's (prefix: 5, 8.9, 16, 32, 48).")
    ] = None,
    rate: Annotated[float, typer.Option(callback=positive,
                                        help="Arrival rate for delta/staleness/lambda/accuracy.")] = 8.0,
    policies: Annotated[str | None, typer.Option(
        callback=policy_list, help="Comma-separated policies (default: BEAR + all baselines).")] = None,
    workers: Annotated[int, typer.Option(min=0, help="Simulation processes (default: one per core).")] = 0,
    out: Annotated[Path, typer.Option(help="Directory for the JSON result and the PNG plot.")] = Path("results"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the result JSON on stdout.")] = False,
) -> None:
    """Reproduce a routing experiment of the paper in a virtual-time simulation of the pool."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bear.evaluation import experiments as ex
    from bear.evaluation import plots

    if experiment not in EXPERIMENTS:
        raise typer.BadParameter(f"unknown experiment {experiment!r}; one of {', '.join(EXPERIMENTS)}")
    console = Console(stderr=True)
    rate_list = [float(x) for x in rates.split(",")] if rates else list(ex.PAPER_RATES)
    pol = policies.split(",") if policies else list(ex.RATE_POLICIES)
    with console.status("preparing predictor, queries and calibration (cached after the first run)"):
        s = ex.setup(seed, n_queries)
    if experiment == "prefix":  # multi-turn sessions with prefix caching (bear.evaluation.prefix)
        from bear.evaluation.prefix import run_prefix_experiment

        result, png = run_prefix_experiment(s, rate_list if rates else None, policies.split(",") if policies else None,
                                            workers, out, console)
        _write(out, experiment, seed, n_queries, result, s, as_json, console, png)
        return
    if experiment in ("rates", "accuracy"):
        cells = ex.rates_cells(rate_list if experiment == "rates" else [rate], pol)
    elif experiment == "estimator":
        cells = ex.rates_cells(rate_list, ["bear", "prefill-throughput"])
    elif experiment == "delta":
        cells = ex.delta_cells(rate)
    elif experiment == "bursty":
        cells = ex.bursty_cells(pol)
    elif experiment == "staleness":
        cells = ex.staleness_cells(rate)
    else:
        cells = ex.lambda_cells(rate, pol)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task(f"{experiment}: simulating", total=len(cells))
        res = ex.run_cells(s, cells, workers=workers or None, on_done=lambda _c: progress.advance(task))
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"{experiment}.png"
    if experiment == "rates":
        result = ex.rates_result(rate_list, pol, res)
        plots.rates(result, png)
    elif experiment == "estimator":
        result = ex.rates_result(rate_list, ["bear", "prefill-throughput"], res)
        plots.xy(result, png, "rates", "BEA vs prefill-throughput under the BEAR rule", "arrival rate (q/s)")
    elif experiment == "delta":
        result = ex.delta_result(rate, res)
        plots.delta(result, png)
    elif experiment == "bursty":
        result = ex.bursty_result(pol, res)
        plots.bursty(result, png)
    elif experiment == "staleness":
        result = ex.staleness_result(rate, res)
        plots.staleness(result, png)
    elif experiment == "lambda":
        result = ex.lambda_result(rate, pol, res)
        plots.xy(result, png, "lambdas", f"OnTimeUtility vs λ at {rate:g} q/s", "λ", log=True)
    else:
        result = ex.accuracy_result(rate, res, pol)
        plots.accuracy(result, png)
    _write(out, experiment, seed, n_queries, result, s, as_json, console, png)


def _write(out: Path, experiment: str, seed: int, n_queries: int, result: dict[str, Any], s: Any, as_json: bool,
           console: Any, png: Path) -> None:
    result = json_safe({"experiment": experiment, "seed": seed, "n_queries": n_queries, **result,
                     "calibration": {k: msgspec.to_builtins(v) for k, v in s.calibration.items()}})
    (out / f"{experiment}.json").write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result))
    else:
        _print_table(console, experiment, result)
        print(f"wrote {out / (experiment + '.json')} and {png}", file=sys.stderr)


def _print_table(console: Any, experiment: str, result: dict[str, Any]) -> None:
    from rich.table import Table

    if "policies" in result and experiment in ("rates", "estimator", "lambda", "prefix"):
        xs = result.get("rates") or result.get("lambdas")
        t = Table(title=f"OnTimeUtility ({experiment})")
        t.add_column("policy")
        for x in xs:
            t.add_column(f"{x:g}")
        for name, vals in result["policies"].items():
            t.add_row(name, *(f"{v:.4f}" if v is not None else "-" for v in vals))
        console.print(t)
        if "gain_over_best_baseline" in result:
            console.print("BEAR vs best baseline per rate: " +
                          ", ".join(f"{g * 100:+.1f}%" for g in result["gain_over_best_baseline"] if g is not None))
    else:
        console.print_json(json.dumps({k: v for k, v in result.items() if k != "calibration"}))


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
