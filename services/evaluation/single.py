"""Experiments on one simulated instance at a time, the whole task mix sent to it: its saturation
throughput and concurrency, the LPS model against the measured TTFT (paper Fig. 7), and the
estimators against the observed TTFT and eq. 12 against the observed batch times (Figs. 4, 5).
Each run goes through the same ``Cluster``, estimator and policy code as the pool experiments."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bear import libbea
from bear.calibrator.fit import RefitPolicy, design_matrix, predict
from bear.estimator.estimate import EstimatorConfig
from bear.evaluation.cluster import Cluster, Oracle
from bear.evaluation.experiments import DEFAULT_LAMBDA, Setup, entries
from bear.evaluation.learned import online_predictions
from bear.load.arrivals import poisson_arrivals
from bear.load.metrics import Outcome
from bear.router.policies import make_policy

LPS_LOADS = [0.2, 0.35, 0.5, 0.65, 0.8, 0.9]  # arrival rate as a fraction of the saturation rate
SCATTER_LOAD = 0.6
SATURATION_RATE = 50.0  # q/s: far above what any instance serves


def run_alone(s: Setup, k: int, times: np.ndarray, policy: str = "bear", estimator: EstimatorConfig | None = None,
              record: bool = False, oracle: Oracle | None = None, refit: bool = True,
              samples: bool = False) -> tuple[list[Outcome], Cluster]:
    """Every query of the setup to instance ``k`` of the pool, at ``times`` (``oracle``: inputs the
    estimator is handed exactly; ``refit``: the calibrator refits online, as live; ``samples``:
    keep the learned predictor's samples, ``Cluster.samples``)."""
    spec = s.specs()[k]
    q = s.queries
    prices = {m: (float(q.price_in[j]), float(q.price_out[j])) for j, m in enumerate(q.models)}
    cl = Cluster([spec], s.calibration, seed=s.seed + 40 + k, estimator=estimator, prices=prices,
                 history=s.history, oracle=oracle, refit=RefitPolicy() if refit else None)
    if record:
        cl.insts[0].records = []
    if samples:
        cl.samples = []
    outs = cl.run(q, times, s.targets(), make_policy(policy), DEFAULT_LAMBDA)
    return outs, cl


def _drain(cl: Cluster) -> None:
    while cl.events:
        cl.advance_to(cl.events[0][0])


def saturation(s: Setup, k: int) -> dict[str, float]:
    """Queries/s the instance completes when always backlogged (μ of eq. 13) and its mean number
    of running requests then (k of eq. 13), over the middle half of the completions."""
    times = poisson_arrivals(SATURATION_RATE, s.n_queries, np.random.default_rng(s.seed + 50))
    _, cl = run_alone(s, k, times)
    _drain(cl)
    done = np.sort(np.array(list(cl.finished_at.values())))
    lo, hi = done[len(done) // 4], done[3 * len(done) // 4]
    inst = cl.insts[0]
    return {"mu_qps": (len(done) // 2) / (hi - lo), "concurrency": inst.running_s / max(inst.busy_s, 1e-9)}


def lps(s: Setup, k: int = 0) -> dict[str, Any]:
    """Fig. 7: measured mean TTFT of the instance alone across arrival rates against eq. 14 with
    μ and k measured at saturation, and the measured mean concurrency at each rate."""
    sat = saturation(s, k)
    mu, conc = sat["mu_qps"], sat["concurrency"]
    theta = s.calibration[s.specs()[k].name].prefill_tps()
    col = s.queries.models.index(s.specs()[k].model)
    mean_prefill = float(np.mean(s.queries.prompt_tokens[:, col])) / theta
    k_lps = max(1, round(conc))
    points = []
    for load in LPS_LOADS:
        alpha = load * mu
        times = poisson_arrivals(alpha, s.n_queries, np.random.default_rng(s.seed + 60))
        outs, cl = run_alone(s, k, times)
        _drain(cl)
        inst = cl.insts[0]
        ttft = [o.ttft_s for o in outs if math.isfinite(o.ttft_s)]
        points.append({
            "load": load, "alpha_qps": alpha, "measured_mean_ttft_s": float(np.mean(ttft)),
            "measured_concurrency": inst.running_s / max(inst.busy_s, 1e-9),
            "lps_mean_ttft_s": libbea.lps_ttft(alpha, mu, k_lps, 0.0, theta) + mean_prefill,
        })
    return {"instance": s.specs()[k].name, "mu_qps": mu, "saturation_concurrency": conc, "k": k_lps,
            "theta": theta, "mean_prefill_s": mean_prefill, "points": points}


BATCH_POINTS = 2000  # batch times kept for Fig. 5's scatter (a run has ~60k; the JSON stays small)


def estimator_scatter(s: Setup, k: int) -> dict[str, Any]:
    """Figs. 4 and 5 on instance ``k`` alone at SCATTER_LOAD of its saturation rate: each query's
    BEA estimate (as the paper describes BEA, and with this project's extensions) and eq. 8
    estimate against its observed TTFT; eq. 12 (the calibrated β) against the observed batch
    times of the same run."""
    mu = saturation(s, k)["mu_qps"]
    times = poisson_arrivals(SCATTER_LOAD * mu, s.n_queries, np.random.default_rng(s.seed + 70))
    es = entries()
    runs = {"bea": ("bear", es["bear"]), "bea+ext": ("bear", es["bear+ext"]),
            "eq8": ("prefill-throughput", es["prefill-throughput"])}
    preds: dict[str, list[float]] = {}
    observed: list[float] = []
    batch: dict[str, Any] = {}
    for key, (policy, e) in runs.items():
        outs, cl = run_alone(s, k, times, policy, EstimatorConfig(**dict(e.estimator)), record=key == "bea",
                             samples=key == "bea")
        preds[key] = [o.predicted_ttft_s for o in outs]
        observed = [o.ttft_s for o in outs]
        if key == "bea":
            assert cl.samples is not None
            preds["learned"] = online_predictions(cl.samples).tolist()
            x, y = design_matrix(cl.insts[0].records)
            yhat = predict(s.calibration[s.specs()[k].name].coefficients, x)
            keep = slice(None, None, max(1, len(y) // BATCH_POINTS))  # the figure's points; MAPE over all
            batch = {"observed_s": y[keep].tolist(), "predicted_s": yhat[keep].tolist(), "n": len(y),
                     "mape": float(np.mean(np.abs(yhat - y) / y))}
    obs = np.array(observed)
    out: dict[str, Any] = {"instance": s.specs()[k].name, "alpha_qps": SCATTER_LOAD * mu, "observed_s": obs.tolist(),
                           "batch": batch}
    for key, p in preds.items():
        a = np.array(p)
        ok = np.isfinite(a) & np.isfinite(obs) & (obs > 0)
        out[key] = {"predicted_s": a.tolist(), "mape": float(np.mean(np.abs(a[ok] - obs[ok]) / obs[ok])),
                    "median_rel_error": float(np.median((a[ok] - obs[ok]) / obs[ok])), "n": int(ok.sum())}
    # the learned predictor predicts only once it has trained: every estimator on those queries
    learned = np.isfinite(np.array(preds["learned"]))
    out["same_queries"] = {key: _mape(np.array(p)[learned], obs[learned]) for key, p in preds.items()}
    return out


def _mape(pred: np.ndarray, obs: np.ndarray) -> float:
    ok = np.isfinite(pred) & np.isfinite(obs) & (obs > 0)
    return float(np.mean(np.abs(pred[ok] - obs[ok]) / obs[ok])) if ok.any() else math.nan
