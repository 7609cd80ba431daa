"""``bear estimate``, ``bear calibrate`` and ``bear bench estimator``: libbea from the shell."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

bench_app = typer.Typer(help="Benchmarks that print numbers (medians, p99, memory).", no_args_is_help=True)


def _load_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def _load_beta(coeffs: Path | None) -> list[float]:
    from bear.estimator.calibration import NOMINAL_BETA, Calibration

    if coeffs is None:
        print("note: no --coeffs given; using the nominal β " + json.dumps(list(NOMINAL_BETA)), file=sys.stderr)
        return list(NOMINAL_BETA)
    raw = _load_json(coeffs)
    if isinstance(raw, list):
        raw = {"beta": raw}
    return list(Calibration.from_json(raw).beta)


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
    from bear.estimator.cases import read_cases, replay_case

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


def calibrate(
    batches: Annotated[
        list[Path], typer.Option("--batches", help="bear.batch/1 JSONL(.gz) file(s); repeat or list several.")
    ],
    out: Annotated[Path, typer.Option(help="Where to write {beta, mape, n} as JSON.")],
    extra: Annotated[list[Path] | None, typer.Argument(help="More batch files.", show_default=False)] = None,
) -> None:
    """Fit eq. 12's β0..β3 by non-negative least squares and report the batch-time MAPE."""
    from bear.estimator.calibration import fit_beta, read_records

    files = list(batches) + list(extra or [])
    cal = fit_beta(read_records(files))
    out.write_text(json.dumps(cal.to_json(), indent=2) + "\n")
    print(
        f"β = [{', '.join(f'{b:.4g}' for b in cal.beta)}]  batch-time MAPE {cal.mape * 100:.1f}% "
        f"over {cal.n} batches -> {out}"
    )


@bench_app.command("estimator")
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
) -> None:
    """Time per BEA estimate (median, p99) and RSS growth over many estimates, three scenarios; then
    estimate time vs population (64/256/1,024 running x 0/64/256/512 waiting)."""
    from bear.estimator.bench import run_bench

    run_bench(n=n, timing_reps=timing_reps, cases_path=cases, as_json=as_json, population_reps=population_reps)


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)
    app.command("calibrate")(calibrate)
    app.add_typer(bench_app, name="bench")
