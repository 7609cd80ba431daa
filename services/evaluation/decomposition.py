"""Where the TTFT estimate's error comes from (``bear eval --experiment decomposition``).

The replay is exact given exact inputs: with every instance's true output lengths, its steps
timed by eq. 12 itself and the later arrivals known, the estimate equals the observed TTFT
(``all exact``: 0 error, asserted by the tests). So each input handed over exactly in turn
(``bear.evaluation.cluster.Oracle``) says what that source costs:

* ``exact lengths`` — every dispatch carries the true output length (the residents' remaining
  decode work and when they leave);
* ``eq. 12 engine`` — the engine's steps take eq. 12's time with the calibrated β, noise-free
  (the batch-time model: the roofline's kink, per-request overheads, noise). In this simulation
  snapshots reach the estimator at every step boundary without delay, so the remaining time of
  the step in flight at the arrival is part of this source;
* ``arrivals known`` — the replay admits the later arrivals when they come (the arrival fill,
  which charges their expectation, is off);
* ``no arrival fill`` — the shipped estimator without the fill (what ignoring them costs);
* ``profiled β only`` — the calibrator never refits: β and θ stay what profiling fitted (the
  simulated pool refits online as ``bear calibrator`` does live, ``RefitPolicy``).

Each instance alone at 30 / 60 / 90 % of its saturation rate, and the chosen instance under the
shipped router (``bear+overflow``) at each paper rate — all through ``Cluster``, the decision
code that runs live. A pool's later arrivals depend on later routing, so the rates part has no
``arrivals known`` row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bear.calibrator.fit import RefitPolicy
from bear.estimator.estimate import EstimatorConfig
from bear.evaluation.cluster import Cluster, Oracle
from bear.evaluation.experiments import DEFAULT_LAMBDA, PAPER_RATES, Setup, arrival_times, cell, entries
from bear.evaluation.single import run_alone, saturation
from bear.load.arrivals import poisson_arrivals
from bear.load.metrics import Outcome
from bear.router.policies import make_policy

LOADS = (0.3, 0.6, 0.9)  # arrival rate as a fraction of the instance's saturation rate
SHIPPED = "bear+overflow"  # the router as shipped: its estimator configuration
# row → (inputs handed over exactly, estimator settings changed, the calibrator refits online)
ALONE_ROWS: dict[str, tuple[Oracle, dict[str, bool], bool]] = {
    "shipped": (Oracle(), {}, True),
    "profiled β only": (Oracle(), {}, False),
    "exact lengths": (Oracle(lengths=True), {}, True),
    "eq. 12 engine": (Oracle(step_times=True), {}, False),
    "arrivals known": (Oracle(arrivals=True), {}, True),
    "no arrival fill": (Oracle(), {"arrival_fill": False}, True),
    "all exact": (Oracle(lengths=True, step_times=True, arrivals=True), {}, False),
}
RATE_ROWS = {k: v for k, v in ALONE_ROWS.items() if not v[0].arrivals}


def errors(outs: list[Outcome]) -> dict[str, float]:
    """MAPE, median and p90 relative error (signed median; p90 of |error|) of the TTFT estimates;
    ``unpredicted``: share with no finite estimate (left out of the rest)."""
    p = np.array([o.predicted_ttft_s for o in outs], dtype=float)
    o = np.array([o.ttft_s for o in outs], dtype=float)
    ok = np.isfinite(p) & np.isfinite(o) & (o > 0)
    r = (p[ok] - o[ok]) / o[ok]
    if not len(r):
        return {"n": 0, "mape": float("nan"), "median": float("nan"), "p90_abs": float("nan"), "unpredicted": 1.0}
    return {"n": int(ok.sum()), "mape": float(np.mean(np.abs(r))), "median": float(np.median(r)),
            "p90_abs": float(np.quantile(np.abs(r), 0.9)), "unpredicted": float(1.0 - ok.mean())}


def _config(changes: dict[str, bool]) -> EstimatorConfig:
    return EstimatorConfig(**{**dict(entries()[SHIPPED].estimator), **changes})


def jobs(s: Setup, rates: tuple[float, ...] = tuple(PAPER_RATES)) -> list[tuple[Any, ...]]:
    return [*(("alone", k) for k in range(len(s.pool))), *(("rate", r) for r in rates)]


def run_job(s: Setup, job: tuple[Any, ...]) -> dict[str, Any]:
    if job[0] == "alone":
        return alone(s, int(job[1]))
    return at_rate(s, float(job[1]))


def alone(s: Setup, k: int, loads: tuple[float, ...] = LOADS) -> dict[str, Any]:
    """Instance ``k`` alone at each load: every row's errors on the same arrivals."""
    mu = saturation(s, k)["mu_qps"]
    points = []
    for load in loads:
        times = poisson_arrivals(load * mu, s.n_queries, np.random.default_rng(s.seed + 80))
        rows = {}
        for name, (oracle, changes, refit) in ALONE_ROWS.items():
            outs, _ = run_alone(s, k, times, "bear", _config(changes), oracle=oracle, refit=refit)
            rows[name] = errors(outs)
        points.append({"load": load, "alpha_qps": load * mu, "rows": rows})
    return {"instance": s.specs()[k].name, "mu_qps": mu, "points": points}


def at_rate(s: Setup, rate: float) -> dict[str, Any]:
    """The pool under the shipped router at ``rate``: the chosen instance's estimate per row."""
    c = cell(SHIPPED, rate, s.seed)
    q = s.queries
    prices = {m: (float(q.price_in[j]), float(q.price_out[j])) for j, m in enumerate(q.models)}
    rows = {}
    for name, (oracle, changes, refit) in RATE_ROWS.items():
        cl = Cluster(s.specs(), s.calibration, seed=s.seed + 4, estimator=_config(changes), prices=prices,
                     history=s.history, oracle=oracle, refit=RefitPolicy() if refit else None)
        outs = cl.run(q, arrival_times(s, c), s.targets(), make_policy(c.policy, **dict(c.params)), DEFAULT_LAMBDA)
        rows[name] = errors(outs)
    return {"rate": rate, "rows": rows}


def combine(outs: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    return {"seed": seed, "router": SHIPPED, "alone": [o for o in outs if "instance" in o],
            "rates": sorted((o for o in outs if "rate" in o), key=lambda o: o["rate"])}


def _pc(x: float) -> str:
    return "–" if not np.isfinite(x) else f"{x * 100:.1f}"


def table(r: dict[str, Any]) -> list[str]:
    """The decomposition as markdown: MAPE / median / p90 |error| in %, per row."""
    head = "| instance | α/μ | q/s | " + " | ".join(ALONE_ROWS) + " |"
    lines = [f"## TTFT error decomposition (seed {r['seed']}): MAPE % (median %, p90 |error| %)", "",
             "Each instance alone:", "", head, "|" + "---|" * (3 + len(ALONE_ROWS))]
    for a in r["alone"]:
        for p in a["points"]:
            cells = [f"{_pc(e['mape'])} ({_pc(e['median'])}, {_pc(e['p90_abs'])})" for e in p["rows"].values()]
            lines.append(f"| {a['instance']} | {p['load']:g} | {p['alpha_qps']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", f"The chosen instance under `{r['router']}`:", "",
              "| q/s | " + " | ".join(RATE_ROWS) + " |", "|" + "---|" * (1 + len(RATE_ROWS))]
    for x in r["rates"]:
        cells = [f"{_pc(e['mape'])} ({_pc(e['median'])}, {_pc(e['p90_abs'])})" for e in x["rows"].values()]
        lines.append(f"| {x['rate']:g} | " + " | ".join(cells) + " |")
    return lines


def write(r: dict[str, Any], out: Path) -> list[str]:
    """``decomposition.md`` (the table) and ``decomposition.png`` (MAPE per source and load)."""
    from bear.evaluation.plots import decomposition as plot

    (out / "decomposition.md").write_text("\n".join(table(r)) + "\n")
    return ["decomposition.md", *plot(r, out)]
