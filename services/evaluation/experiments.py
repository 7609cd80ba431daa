"""The paper's experiments over the virtual-time pool, each returning a JSON-able result.

Every experiment shares one setup per seed (trained predictor, evaluation queries with their
predictions, per-instance calibration), cached on disk, and runs its (policy, setting) cells in
a process pool so that both cores work.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bear.estimator.estimate import EstimatorConfig
from bear.evaluation.cluster import PAPER_POOL, Cluster, InstanceSpec, calibrate_pool
from bear.evaluation.workload import QuerySet, build_queries
from bear.load.arrivals import Mmpp2, poisson_arrivals
from bear.load.metrics import summary
from bear.load.targets import ttft_target_s
from bear.predictor.synth import default_cache_dir, trained_predictor_dir
from bear.protocol.messages import Calibration
from bear.router.policies import BASELINES, make_policy

RATE_POLICIES = ["bear", *BASELINES, "prefill-throughput"]
PAPER_RATES = [5.0, 6.0, 7.0, 8.0, 8.9]
DEFAULT_LAMBDA = 5e-4


@dataclass
class Setup:
    seed: int
    n_queries: int
    queries: QuerySet
    calibration: dict[str, Calibration]
    pool: list[str] = field(default_factory=lambda: list(PAPER_POOL))

    def specs(self) -> list[InstanceSpec]:
        return [InstanceSpec.from_profile(p) for p in self.pool]

    def targets(self) -> np.ndarray:
        return ttft_target_s(self.queries.prompt_tokens[:, 0], np.random.default_rng(self.seed + 2))


def setup(seed: int, n_queries: int, cache: Path | None = None, n_train: int = 3000, n_calib: int = 400) -> Setup:
    """Predictor trained on synthetic data (seed-disjoint), evaluation and calibration queries,
    per-instance calibration: built once per (seed, n) and cached."""
    cache = cache or default_cache_dir()
    path = cache / f"eval-setup-v3-{seed}-{n_queries}-{n_train}-{n_calib}.pkl"
    if path.exists():
        with open(path, "rb") as f:
            return pickle.load(f)
    pred_dir = trained_predictor_dir(n_train, seed=10_000 + seed, cache=cache)
    specs = [InstanceSpec.from_profile(p) for p in PAPER_POOL]
    limit = min(sp.max_prompt_tokens for sp in specs)
    qs = build_queries(n_queries, seed=seed, predictor_dir=pred_dir, max_prompt_tokens=limit)
    cal_qs = build_queries(n_calib, seed=20_000 + seed, predictor_dir=pred_dir, max_prompt_tokens=limit)
    s = Setup(seed=seed, n_queries=n_queries, queries=qs, calibration=calibrate_pool(specs, cal_qs, seed=seed + 3))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(s, f)
    return s


@dataclass(frozen=True)
class Cell:
    """One simulation: a policy (with parameters) under one arrival setting."""

    policy: str
    rate: float
    params: tuple[tuple[str, float], ...] = ()
    arrivals: str = "poisson"
    ratio: float = 1.0
    delay_s: float = 0.0
    compensate: bool = True
    use_dispatches: bool = True
    arrival_fill: bool = True
    max_age_s: float = EstimatorConfig.max_age_s
    lam: float = DEFAULT_LAMBDA

    def estimator(self) -> EstimatorConfig:
        """The estimator configuration of this cell (the live worker's defaults otherwise)."""
        return EstimatorConfig(compensate_staleness=self.compensate, use_dispatches=self.use_dispatches,
                               arrival_fill=self.arrival_fill, max_age_s=self.max_age_s)


def arrival_times(s: Setup, cell: Cell) -> np.ndarray:
    rng = np.random.default_rng(s.seed + 1)
    n = s.n_queries
    if cell.arrivals == "mmpp":
        return Mmpp2(cell.rate, cell.ratio).arrivals(n, rng)[0]
    return poisson_arrivals(cell.rate, n, rng)


def run_cell(s: Setup, cell: Cell) -> dict[str, Any]:
    policy = make_policy(cell.policy, **dict(cell.params))
    q = s.queries
    prices = {m: (float(q.price_in[j]), float(q.price_out[j])) for j, m in enumerate(q.models)}
    cluster = Cluster(s.specs(), s.calibration, seed=s.seed + 4, delay_s=cell.delay_s, estimator=cell.estimator(),
                      prices=prices)
    outcomes = cluster.run(s.queries, arrival_times(s, cell), s.targets(), policy, cell.lam)
    return summary(outcomes)


_WORKER_SETUP: Setup | None = None


def _init_worker(setup_obj: Setup) -> None:
    global _WORKER_SETUP
    _WORKER_SETUP = setup_obj


def _run_in_worker(cell: Cell) -> tuple[Cell, dict[str, Any]]:
    assert _WORKER_SETUP is not None
    return cell, run_cell(_WORKER_SETUP, cell)


def run_cells(s: Setup, cells: list[Cell], workers: int | None = None,
              on_done: Callable[[Cell], None] | None = None) -> dict[Cell, dict[str, Any]]:
    workers = workers or min(len(cells), os.cpu_count() or 1)
    results: dict[Cell, dict[str, Any]] = {}
    if workers <= 1:
        for c in cells:
            results[c] = run_cell(s, c)
            if on_done:
                on_done(c)
        return results
    with ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(s,)) as ex:
        for cell, res in ex.map(_run_in_worker, cells):
            results[cell] = res
            if on_done:
                on_done(cell)
    return results


# ---------------------------------------------------------------------------------- experiments
def gain_over_best_baseline(table: dict[str, list[float]], ours: str = "bear") -> list[float]:
    """Per rate: (ours − best other) / best other."""
    others = [k for k in table if k != ours]
    if ours not in table or not others:
        return []
    out = []
    for k, v in enumerate(table[ours]):
        best = max(table[o][k] for o in others)
        out.append((v - best) / best if best > 0 else math.inf)
    return out


def rates_cells(rates: Iterable[float], policies: Iterable[str]) -> list[Cell]:
    return [Cell(p, r) for r in rates for p in policies]


def rates_result(rates: list[float], policies: list[str], res: dict[Cell, dict[str, Any]]) -> dict[str, Any]:
    table = {p: [res[Cell(p, r)]["on_time_utility"] for r in rates] for p in policies}
    return {
        "rates": rates,
        "policies": table,
        "slo_attainment": {p: [res[Cell(p, r)]["slo_attainment"] for r in rates] for p in policies},
        "composition": {p: [res[Cell(p, r)]["composition"] for r in rates] for p in policies},
        "mean_ttft_s": {p: [res[Cell(p, r)]["mean_ttft_s"] for r in rates] for p in policies},
        "gain_over_best_baseline": gain_over_best_baseline(
            {p: v for p, v in table.items() if p != "prefill-throughput"}),
    }


DELTAS = [0.0, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]


def delta_cells(rate: float) -> list[Cell]:
    cells = [Cell("bear-lagrange", rate, (("delta", d),)) for d in DELTAS]
    cells += [Cell(p, rate) for p in ("bear", *BASELINES)]
    return cells


def delta_result(rate: float, res: dict[Cell, dict[str, Any]]) -> dict[str, Any]:
    curve = [{"delta": d, "mean_utility": res[Cell("bear-lagrange", rate, (("delta", d),))]["mean_utility"],
              "mean_ttft_s": res[Cell("bear-lagrange", rate, (("delta", d),))]["mean_ttft_s"]} for d in DELTAS]
    points = {p: {"mean_utility": res[Cell(p, rate)]["mean_utility"], "mean_ttft_s": res[Cell(p, rate)]["mean_ttft_s"]}
              for p in ("bear", *BASELINES)}
    return {"rate": rate, "lagrange": curve, "policies": points}


BURSTY_RATES = [6.0, 7.0, 8.0]


def bursty_cells(policies: list[str]) -> list[Cell]:
    return [Cell(p, r, arrivals="mmpp", ratio=ratio) for ratio in (3.0, 6.0) for r in BURSTY_RATES for p in policies]


def bursty_result(policies: list[str], res: dict[Cell, dict[str, Any]]) -> dict[str, Any]:
    return {f"r={int(ratio)}": {"rates": BURSTY_RATES,
                                "policies": {p: [res[Cell(p, r, arrivals="mmpp", ratio=ratio)]["on_time_utility"]
                                                 for r in BURSTY_RATES] for p in policies}}
            for ratio in (3.0, 6.0)}


DELAYS = [0.0, 0.025, 0.1, 0.4, 1.0]


def staleness_cells(rate: float) -> list[Cell]:
    # BEA on snapshots up to 1 s old: the fallback age is raised above the largest delay studied.
    return [Cell("bear", rate, delay_s=d, compensate=c, max_age_s=2.0) for d in DELAYS for c in (True, False)]


def staleness_result(rate: float, res: dict[Cell, dict[str, Any]]) -> dict[str, Any]:
    return {"rate": rate, "delays_s": DELAYS,
            "compensated": [res[Cell("bear", rate, delay_s=d, compensate=True, max_age_s=2.0)]["on_time_utility"] for d in DELAYS],
            "uncompensated": [res[Cell("bear", rate, delay_s=d, compensate=False, max_age_s=2.0)]["on_time_utility"] for d in DELAYS]}


LAMBDAS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3]


def lambda_cells(rate: float, policies: list[str]) -> list[Cell]:
    return [Cell(p, rate, lam=lam) for lam in LAMBDAS for p in policies]


def lambda_result(rate: float, policies: list[str], res: dict[Cell, dict[str, Any]]) -> dict[str, Any]:
    return {"rate": rate, "lambdas": LAMBDAS,
            "policies": {p: [res[Cell(p, rate, lam=lam)]["on_time_utility"] for lam in LAMBDAS] for p in policies}}


def accuracy_result(rate: float, res: dict[Cell, dict[str, Any]], policies: list[str]) -> dict[str, Any]:
    return {"rate": rate, "policies": {p: res[Cell(p, rate)]["ttft_prediction"] for p in policies}}
