"""Run a set of experiments: the setups they need (built in parallel, cached), all their cells in
one process pool, the single-instance experiments, then one JSON and its PNGs per experiment and,
for more than one experiment, a generated summary page."""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from bear.evaluation import decomposition, diagnose, plots, single
from bear.evaluation.experiments import SENSITIVITY, Setup, Variant, run_cells, setup
from bear.evaluation.suite import PAPER, registry
from bear.evaluation.workload import length_distributions
from bear.protocol.codec import json_safe

SINGLE = {"lps": "Fig. 7", "estimates": "Figs. 4, 5", "workload": "Figs. 12, 13",
          "diagnose": "evidence for Figs. 1 and 16", "decomposition": "beyond the paper: where the TTFT error comes from"}
# `all`: the paper's experiments and the sensitivity studies. The prefix experiment (beyond the
# paper, ≈ 200 CPU-seconds) runs alone: with it `all` took 15.7 min on the shared 2-core host.
ALL = ["rates", "delta", "staleness", "lambda", "bursty", "sensitivity", "highload",
       *(n for n in SINGLE if n != "decomposition")]  # the decomposition (≈ 80 runs) runs alone too
PLOTS: dict[str, Callable[[dict[str, Any], Path], list[str]]] = {
    "rates": plots.rates, "estimator": functools.partial(plots.rates, stem="estimator"),
    "accuracy": functools.partial(plots.rates, stem="accuracy"), "highload": functools.partial(plots.rates, stem="highload"),
    "delta": plots.delta, "staleness": plots.staleness, "lambda": plots.lambdas, "bursty": plots.bursty,
    "sensitivity": plots.sensitivity, "tune": plots.tune, "prefix": plots.prefix, "lps": plots.lps, "estimates": plots.estimates,
    "workload": plots.workload, "diagnose": lambda _r, _o: [], "decomposition": decomposition.write,
    "herd": plots.herd, "reliability": plots.reliability_curves, "fleet": lambda _r, _o: []}
VARIANTS = {v.name: v for v in SENSITIVITY}


def experiment_names() -> list[str]:
    return [*registry(), *SINGLE, "all"]


def _build(key: tuple[int, str], n_queries: int) -> tuple[tuple[int, str], Setup]:
    seed, v = key
    return key, setup(seed, n_queries, variant=VARIANTS.get(v, Variant()))


def build_setups(keys: set[tuple[int, str]], n_queries: int, workers: int) -> dict[tuple[int, str], Setup]:
    """Base setups first (they train predictors and build queries), then the variants (which
    reuse their seed's queries), each stage in parallel."""
    out: dict[tuple[int, str], Setup] = {}
    for stage in (sorted(k for k in keys if not k[1]), sorted(k for k in keys if k[1])):
        if not stage:
            continue
        if workers <= 1 or len(stage) == 1:
            out.update(_build(k, n_queries) for k in stage)
        else:
            with ProcessPoolExecutor(max_workers=min(workers, len(stage))) as ex:
                out.update(ex.map(functools.partial(_build, n_queries=n_queries), stage))
    return out


def _single(name: str, s: Setup, k: Any = 0) -> dict[str, Any]:
    if name == "lps":
        return single.lps(s, k)
    if name == "diagnose":
        return diagnose.traced_run(s, *k)
    if name == "decomposition":
        return decomposition.run_job(s, k)
    return single.estimator_scatter(s, k)


def run_single(names: Sequence[str], s: Setup, workers: int) -> dict[str, dict[str, Any]]:
    jobs: list[tuple[str, Any]] = [("lps", 0)] if "lps" in names else []
    if "estimates" in names:
        jobs += [("estimates", k) for k in range(len(s.pool))]
    if "diagnose" in names:
        jobs += [("diagnose", (e, r)) for e in diagnose.ENTRIES for r in diagnose.RATES]
    if "decomposition" in names:
        jobs += [("decomposition", j) for j in decomposition.jobs(s)]
    results: dict[str, Any] = {}
    if "workload" in names:
        results["workload"] = {"seed": s.seed, **length_distributions(s.queries)}
    for name in names:
        results.setdefault(name, {})["figure"] = SINGLE[name]
    if not jobs:
        return results
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(jobs)))) as ex:
        outs = list(ex.map(_single, [j[0] for j in jobs], [s] * len(jobs), [j[1] for j in jobs]))
    parts = [o for (name, _k), o in zip(jobs, outs, strict=True) if name == "decomposition"]
    if parts:
        results["decomposition"].update(decomposition.combine(parts, s.seed))
    for (name, _k), o in zip(jobs, outs, strict=True):
        r = results[name]
        if name == "decomposition":
            continue
        if name == "diagnose":
            r.setdefault("runs", []).append(o)
        elif name == "lps":
            r.update(o, paper={"k": PAPER["lps_k"], "concurrency": PAPER["lps_measured_concurrency"]})
        else:
            r.setdefault("instances", []).append(o)
            r["paper"] = {k: PAPER[k] for k in ("bea_mape", "eq8_mape", "eq12_mape")}
        r["seed"] = s.seed
    return results


def run(names: Sequence[str], seeds: Sequence[int], n_queries: int, out: Path, workers: int = 0,
        on_cells: Callable[[int], None] | None = None, on_done: Callable[[], None] | None = None,
        rates: Sequence[float] | None = None, policies: Sequence[str] | None = None,
        arrivals: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Run the named experiments over ``seeds`` (single-seed ones on the first) and write
    ``out/<name>.json`` and its PNGs; returns the results by name. ``rates``, ``policies`` and
    ``arrivals`` (the cells' arrival settings) apply to the experiments of ``suite.SELECTABLE``."""
    workers = workers or os.cpu_count() or 1
    reg = registry(rates, policies, arrivals)
    exps = [reg[n] for n in names if n in reg]
    t0 = time.monotonic()
    cells = [c for e in exps for c in e.cells(seeds if e.multi_seed else seeds[:1])]
    keys = {c.key for c in cells} | ({(seeds[0], "")} if any(n in SINGLE for n in names) else set())
    setups = build_setups(keys, n_queries, workers)
    if on_cells:
        on_cells(len(set(cells)))
    res = run_cells(setups, cells, workers=workers, on_done=(lambda _c: on_done()) if on_done else None)
    results = {e.name: {"experiment": e.name, "figure": e.figure, **e.result(res, seeds if e.multi_seed else seeds[:1])}
               for e in exps}
    results.update(run_single([n for n in names if n in SINGLE], setups[(seeds[0], "")], workers))
    out.mkdir(parents=True, exist_ok=True)
    for name, r in results.items():
        r["n_queries"] = n_queries
        r["calibration"] = {k: msgspec.to_builtins(v) for k, v in setups[(seeds[0], "")].calibration.items()}
        r["files"] = PLOTS[name](r, out)
        (out / f"{name}.json").write_text(json.dumps(json_safe(r), indent=1))
    if len(results) > 1:
        from bear.evaluation.report import write_summary

        write_summary(results, out, wall_s=time.monotonic() - t0, workers=workers)
    return results
