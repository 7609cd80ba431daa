"""``bear eval``: run the paper's experiments in the simulated pool and write their JSON results,
PNG figures and (for several) a summary page."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from bear.commands.options import policy_list, positive_list

# Kept here (not imported from bear.evaluation.run) so that `bear --help` stays fast; a test
# checks that it equals run.experiment_names().
EXPERIMENTS = ["rates", "estimator", "accuracy", "delta", "staleness", "lambda", "bursty", "sensitivity",
               "highload", "tune", "lps", "estimates", "workload", "diagnose", "decomposition", "prefix", "herd",
               "reliability", "fleet", "all"]
HEADLINE_SEEDS = "2026,2027,2028"


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"{what}: comma-separated integers, got {text!r}") from exc


def default_out(experiment: str, seeds: list[int]) -> Path:
    """One dated folder per `all` run; a single experiment in a folder of its own inside it. Under
    ``./results/`` of the current directory (ignored by git): a run never writes into a checkout's
    committed docs/results/ unless ``--out`` names it."""
    day = Path("results") / time.strftime("%Y-%m-%d", time.gmtime())
    return day if experiment == "all" else day / f"{experiment}-{'-'.join(map(str, seeds))}"


def eval_cmd(
    experiment: Annotated[str, typer.Option(help=f"Which experiment: {', '.join(EXPERIMENTS)}.")] = "rates",
    seed: Annotated[int | None, typer.Option(help="One seed (queries, arrivals, targets, engine noise).")] = None,
    seeds: Annotated[str | None, typer.Option(
        help=f"Comma-separated seeds; default {HEADLINE_SEEDS.split(',')[0]} for one experiment, "
             f"{HEADLINE_SEEDS} for all. Single-seed parts (sensitivity, lps, estimates, workload, tune) use the first.")] = None,
    n_queries: Annotated[int, typer.Option(min=1, help="Queries per simulated run (prefix: turns).")] = 2000,
    rates: Annotated[str | None, typer.Option(
        callback=positive_list,
        help="Comma-separated arrival rates (q/s) for rates/estimator/prefix; default: the paper's 5,6,7,8,8.9 "
             "(prefix: 5,8.9,16,32,48).")] = None,
    policies: Annotated[str | None, typer.Option(
        callback=policy_list,
        help="Comma-separated routing policies: run only the routers of these (rates, estimator, accuracy, highload, "
             "prefix; default: every router of comparison.json, prefix: its five).")] = None,
    workers: Annotated[int, typer.Option(min=0, help="Simulation processes (0: one per core).")] = 0,
    out: Annotated[Path | None, typer.Option(
        help="Folder for the JSON results, PNG figures and summary.md; default ./results/<UTC date> for all, "
             "./results/<UTC date>/<experiment>-<seeds> for one experiment (relative to the current directory).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the (single) experiment's JSON on stdout.")] = False,
    arrivals: Annotated[str, typer.Option(
        help="Arrival process of rates/estimator/accuracy/highload: poisson, mmpp (MMPP-2, --burst-ratio) or "
             "batch (--batch-size queries at one instant, the instants Poisson at rate / size).")] = "poisson",
    burst_ratio: Annotated[float, typer.Option(min=1.0, help="mmpp: the burst ratio r = α_H / α_L (App. B: 3, 6).")] = 3.0,
    batch_size: Annotated[int, typer.Option(min=1, help="batch: queries per instant.")] = 20,
    decisions: Annotated[str, typer.Option(
        help="sequenced (each decision sees every one before it; the live router) or concurrent (arrivals within "
             "--decision-window-ms of each other decided on one view, none seeing another: the old live herd).")]
        = "sequenced",
    decision_window_ms: Annotated[float, typer.Option(min=0.0, help="concurrent: the window (0: the same instant).")]
        = 0.0,
) -> None:
    """Reproduce the paper's routing experiments in a virtual-time simulation of the pool."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bear.evaluation import run as runner

    if experiment not in EXPERIMENTS:
        raise typer.BadParameter(f"unknown experiment {experiment!r}; one of {', '.join(EXPERIMENTS)}")
    if seed is not None and seeds is not None:
        raise typer.BadParameter("give --seed or --seeds, not both")
    seed_list = [seed] if seed is not None else _ints(seeds or (
        HEADLINE_SEEDS if experiment == "all" else HEADLINE_SEEDS.split(",")[0]), "--seeds")
    if experiment == "tune":
        from bear.evaluation.experiments import load_config

        seed_list = seed_list if (seed is not None or seeds) else [int(load_config()["tuning"]["seed"])]
    try:
        rate_list = [float(x) for x in rates.split(",")] if rates else None
    except ValueError as exc:
        raise typer.BadParameter(f"--rates: comma-separated numbers, got {rates!r}") from exc
    names = runner.ALL if experiment == "all" else [experiment]
    pol = policies.split(",") if policies else None
    if pol is not None:
        from bear.evaluation.suite import SELECTABLE, registry

        if experiment not in SELECTABLE:
            raise typer.BadParameter(f"--policies applies to {', '.join(SELECTABLE)}, not {experiment}")
        if not registry(rate_list, pol)[experiment].cells(seed_list[:1]):
            raise typer.BadParameter(f"--policies: no router of {experiment} runs {policies}")
    arr = _arrivals(arrivals, burst_ratio, batch_size, decisions, decision_window_ms)
    if arr and experiment not in ("rates", "estimator", "accuracy", "highload"):
        raise typer.BadParameter("--arrivals/--decisions apply to rates, estimator, accuracy and highload "
                                 "(herd and reliability set their own)")
    out = out or default_out(experiment, seed_list)
    console = Console(stderr=True)
    t0 = time.monotonic()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task(f"{experiment}: setups (cached after the first run)", total=None)

        def started(n: int) -> None:
            progress.update(task, description=f"{experiment}: simulating", total=n, completed=0)

        results = runner.run(names, seed_list, n_queries, out, workers=workers, on_cells=started,
                             on_done=lambda: progress.advance(task), rates=rate_list, policies=pol,
                             arrivals=arr or None)
    wall = time.monotonic() - t0
    if as_json:
        from bear.protocol.codec import json_safe

        print(json.dumps(json_safe(results[names[0]] if len(names) == 1 else results)))
    else:
        for name, r in results.items():
            _print(console, name, r)
    print(f"{experiment}: {wall:.0f} s; wrote {out}/ ({', '.join(f'{n}.json' for n in results)}"
          + (", summary.md" if len(results) > 1 else "") + ")", file=sys.stderr)


def _arrivals(kind: str, ratio: float, batch: int, decisions: str, window_ms: float) -> dict[str, Any]:
    """The cells' arrival settings the options ask for ({} : Poisson, sequenced — the defaults)."""
    if kind not in ("poisson", "mmpp", "batch"):
        raise typer.BadParameter(f"--arrivals: poisson, mmpp or batch, not {kind!r}")
    if decisions not in ("sequenced", "concurrent"):
        raise typer.BadParameter(f"--decisions: sequenced or concurrent, not {decisions!r}")
    if window_ms and decisions != "concurrent":
        raise typer.BadParameter("--decision-window-ms needs --decisions concurrent")
    out: dict[str, Any] = {}
    if kind != "poisson":
        out["arrivals"] = kind
    if kind == "mmpp":
        out["ratio"] = float(ratio)
    if kind == "batch":
        out["batch_size"] = int(batch)
    if decisions != "sequenced":
        out["decisions"], out["window_s"] = decisions, window_ms / 1e3
    return out


def _print(console: Any, name: str, r: dict[str, Any]) -> None:
    from rich.table import Table

    if "on_time_utility" in r and "rates" in r and isinstance(r["on_time_utility"], dict) and "entries" in r \
            and name in ("rates", "estimator", "accuracy", "highload", "prefix"):
        t = Table(title=f"OnTimeUtility ({name}; mean over seeds {', '.join(map(str, r['seeds']))})")
        t.add_column("router")
        for x in r["rates"]:
            t.add_column(f"{x:g}")
        for n, v in r["on_time_utility"].items():
            t.add_row(n, *(f"{m:.4f}" for m in v["mean"]))
        console.print(t)
        for ours, g in r.get("gains", {}).items():
            console.print(f"{ours} vs best baseline per rate: " + ", ".join(f"{x * 100:+.1f}%" for x in g["mean"])
                          + f"; average {g['average']['mean'] * 100:+.1f}% "
                          f"[{g['average']['min'] * 100:+.1f}, {g['average']['max'] * 100:+.1f}]")
        for ours, g in r.get("estimator_gain", {}).items():
            console.print(f"{ours} vs eq. 8 under the same rule: " + ", ".join(f"{x * 100:+.1f}%" for x in g["mean"]))
    elif name == "prefix":
        t = Table(title=f"OnTimeUtility (prefix; multi-turn sessions, seed {r['seeds'][0]})")
        t.add_column("policy")
        for x in r["rates"]:
            t.add_column(f"{x:g}")
        for n, v in r["policies"].items():
            t.add_row(n, *(f"{m:.4f}" for m in v))
        console.print(t)
    elif name in ("herd", "reliability"):
        panels = r["modes"] if name == "herd" else r["arrivals"]
        for panel, v in panels.items():
            t = Table(title=f"OnTimeUtility ({name}, {panel}; mean over seeds {', '.join(map(str, r['seeds']))})")
            t.add_column("router")
            for x in r["rates"]:
                t.add_column(f"{x:g}")
            for n, st in v["on_time_utility"].items():
                t.add_row(n, *(f"{m:.4f}" for m in st["mean"]))
            console.print(t)
            for n, rel in v.get("reliability", {}).items():
                console.print(f"{panel} {n} (confidence {rel['confidence']:g}): on time among feasible per seed "
                              + ", ".join(f"{s}: {d['share']:.3f} of {int(d['n'])}" for s, d in rel["per_seed"].items()))
    elif name == "fleet":
        t = Table(title=f"OnTimeUtility at fleet scale (seed {r['seeds'][0]}; rate per instance, q/s)")
        for col in ("arrivals", "instances", "q/s/inst", "router", "queries", "OnTimeUtility", "replays/query",
                    "decisions/CPU-s"):
            t.add_column(col)
        for row in r["rows"]:
            t.add_row(row["arrivals"], str(row["size"]), f"{row['rate_per_instance']:.2f}", row["router"],
                      str(row["queries"]), f"{row['on_time_utility']:.4f}", f"{row['replays_per_query']:.1f}",
                      f"{row['decisions_per_cpu_s']:.0f}")
        console.print(t)
    elif name == "tune":
        console.print(f"tuned on seed(s) {r['seeds']}: {json.dumps(r['chosen'])}")
    else:
        console.print(f"{name}: {', '.join(r.get('files', []))}")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
