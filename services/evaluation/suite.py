"""The experiments of the paper, each a set of cells over the seeds and a function that turns
their results into the figure's data (mean and range over seeds, the paper's number beside)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bear.evaluation import reliability as rel
from bear.evaluation.experiments import (
    PAPER_RATE,
    PAPER_RATES,
    SENSITIVITY,
    Cell,
    baselines,
    best_baseline,
    cell,
    entries,
    gain_over_best,
    load_config,
    rate_entries,
    spread,
)

Results = dict[Cell, dict[str, Any]]

# The paper's numbers each experiment is compared with (Mind the Delay, arXiv 2607.18253).
PAPER = {
    "gain_over_best_baseline": 0.305,  # §5.2, Fig. 8: average over the rates
    "gain_over_routebalance_score": 0.63,  # §5.2: average over the rates
    "max_gain_over_routebalance_score": 0.74,  # §5.2: at 8.9 q/s
    "staleness_drop_at_1s": 0.07,  # App. F, Fig. 14 (close to zero-delay up to 400 ms)
    "bea_mape": 0.05, "eq8_mape": 0.85,  # Fig. 4 (Qwen3-0.6B on one H100)
    "eq12_mape": 0.04,  # Fig. 5
    "lps_k": 25, "lps_measured_concurrency": 25.7,  # Fig. 7
}

DELTAS = [0.0, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
DELAYS = [0.0, 0.025, 0.1, 0.4, 1.0]  # App. F, Fig. 14
LAMBDAS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3]
BURSTY_RATES = [6.0, 7.0, 8.0]  # App. B, Table 3
BURST_RATIOS = [3.0, 6.0]
SENSITIVITY_RATES = [5.0, 8.0]
HIGH_LOAD_RATES = [10.0, 12.0]
COMPOSITION = ["bear", "bear+ext", "bear+overflow", "shortest-queue", "latency-agnostic", "round-robin",  # Fig. 1
               "score", "routebalance"]
STALE_MAX_AGE_S = 2.0  # BEA on snapshots up to 1 s old: the fallback age above the largest delay


@dataclass(frozen=True)
class Experiment:
    name: str
    figure: str
    cells: Callable[[Sequence[int]], list[Cell]]
    result: Callable[[Results, Sequence[int]], dict[str, Any]]
    multi_seed: bool = True  # run over every seed given (else the first)


def _per_seed(res: Results, seeds: Sequence[int], make: Callable[[int], Sequence[Cell]], metric: str) -> dict:
    """{metric per seed: [value per cell]} plus mean/min/max per position."""
    per = {s: [res[c][metric] for c in make(s)] for s in seeds}
    cols = list(zip(*per.values(), strict=True))
    return {"per_seed": per, "mean": [spread(c)["mean"] for c in cols], "min": [min(c) for c in cols],
            "max": [max(c) for c in cols]}


def _labels(names: Sequence[str]) -> dict[str, dict[str, str]]:
    es = entries()
    return {n: {"label": es[n].label, "role": es[n].role} for n in names}


# ------------------------------------------------------------------------------------- rates
def rates_experiment(rates: Sequence[float] = PAPER_RATES, names: Sequence[str] | None = None,
                     name: str = "rates", figure: str = "Figs. 8, 1, 16, 18, 19",
                     arrivals: Mapping[str, Any] | None = None) -> Experiment:
    """``arrivals``: the cells' arrival settings (``Cell.arrivals``, ``ratio``, ``batch_size``,
    ``decisions``, ``window_s``; ``bear eval --arrivals …``); none: Poisson, sequenced."""
    names = list(rate_entries() if names is None else names)
    kw = dict(arrivals or {})

    def cells(seeds: Sequence[int]) -> list[Cell]:
        return [cell(n, r, s, **kw) for s in seeds for n in names for r in rates]

    def result(res: Results, seeds: Sequence[int]) -> dict[str, Any]:
        def cell(n: str, r: float, s: int) -> Cell:  # the cells of this experiment's arrivals
            return _cell(n, r, s, **kw)

        def row(n: str) -> Callable[[int], list[Cell]]:
            return lambda s: [cell(n, r, s) for r in rates]

        out: dict[str, Any] = {"rates": list(rates), "seeds": list(seeds), "entries": _labels(names),
                               "arrivals": _arrivals_of(kw)}
        for metric in ("on_time_utility", "slo_attainment", "mean_ttft_s", "mean_utility"):
            out[metric] = {n: _per_seed(res, seeds, row(n), metric) for n in names}
        out["composition"] = {n: [_composition([res[cell(n, r, s)]["composition"] for s in seeds])
                                  for r in rates] for n in names if n in COMPOSITION}
        out["composition_by_task"] = {
            n: [{t: _composition([res[cell(n, r, s)]["composition_by_task"].get(t, {}) for s in seeds])
                 for t in sorted({t for s in seeds for t in res[cell(n, r, s)]["composition_by_task"]})}
                for r in rates] for n in names if n in COMPOSITION}
        out["ttft_prediction_by_instance"] = {
            n: [_prediction([res[cell(n, r, s)]["ttft_prediction_by_instance"] for s in seeds]) for r in rates]
            for n in names}
        out["ttft_prediction"] = {n: [spread(res[cell(n, r, s)]["ttft_prediction"]["mape"] for s in seeds)
                                      for r in rates] for n in names}
        # the learned predictor (bear.evaluation.learned) on each entry's chosen instances, and the
        # entry's own estimate on the queries the learned one predicts
        for key in ("ttft_prediction_learned", "ttft_prediction_same_queries"):
            out[key] = {n: [spread(res[cell(n, r, s)][key]["mape"] for s in seeds) for r in rates] for n in names
                        if all(key in res[cell(n, r, s)] for r in rates for s in seeds)}
        base = [b for b in baselines() if b in names]
        if base:
            out["gains"] = {o: _gains(res, seeds, rates, o, base, kw) for o in OURS if o in names}
            rs = [b for b in ("routebalance", "score") if b in names]
            if rs:
                out["gains_over_routebalance_score"] = {o: _gains(res, seeds, rates, o, rs, kw)
                                                        for o in OURS if o in names}
        if "prefill-throughput" in names:
            out["estimator_gain"] = {o: _gains(res, seeds, rates, o, ["prefill-throughput"], kw)  # same rule: eq. 5's
                                     for o in ("bear", "bear+ext") if o in names}
            if "bear+overflow" in names and "prefill-throughput+overflow" in names:  # same rule: the overflow one
                out["estimator_gain"]["bear+overflow"] = _gains(res, seeds, rates, "bear+overflow",
                                                                ["prefill-throughput+overflow"], kw)
        out["paper"] = {k: PAPER[k] for k in ("gain_over_best_baseline", "gain_over_routebalance_score",
                                               "max_gain_over_routebalance_score")}
        out["reliability"] = {n: _reliability(res, seeds, rates, n, kw) for n in names
                              if entries()[n].policy == "bear"}
        return out

    return Experiment(name, figure, cells, result)


OURS = ("bear", "bear+ext", "bear+overflow", "bear+confidence")


def _arrivals_of(kw: Mapping[str, Any]) -> dict[str, Any]:
    c = _cell("bear", 1.0, 0, **kw)
    return {"arrivals": c.arrivals, "ratio": c.ratio, "batch_size": c.batch_size, "decisions": c.decisions,
            "window_s": c.window_s}


def _reliability(res: Results, seeds: Sequence[int], rates: Sequence[float], n: str,
                 kw: Mapping[str, Any]) -> dict[str, Any]:
    """An entry's on-time share among the queries it marked feasible, per seed and rate, and its
    reliability curve pooled over seeds and rates."""
    cs = {s: [_cell(n, r, s, **kw) for r in rates] for s in seeds}
    counts = {s: [res[c]["feasible"] for c in v] for s, v in cs.items()}
    pooled_seed = {s: {k: sum(f[k] for f in v) for k in v[0]} for s, v in counts.items()}
    return {"confidence": dict(entries()[n].params).get("confidence", 0.0),
            "feasible_on_time_share": {s: [rel.share(f) for f in v] for s, v in counts.items()},
            "feasible_on_time_share_with_p": {s: [rel.share(f, True) for f in v] for s, v in counts.items()},
            "feasible_share_of_queries": {s: [f["n"] / f["n_queries"] for f in v] for s, v in counts.items()},
            "per_seed": {s: {"share": rel.share(f), "share_with_p": rel.share(f, True), **f}
                         for s, f in pooled_seed.items()},
            "curve": rel.curve(rel.pooled([res[c]["reliability"] for v in cs.values() for c in v]))}


_cell = cell


def _gains(res: Results, seeds: Sequence[int], rates: Sequence[float], ours: str, others: Sequence[str],
           kw: Mapping[str, Any] | None = None) -> dict:
    per, best = {}, {}
    kw = kw or {}
    for s in seeds:
        table = {n: [res[cell(n, r, s, **kw)]["on_time_utility"] for r in rates] for n in (ours, *others)}
        per[s] = gain_over_best(table, ours, others)
        best[s] = best_baseline(table, others)
    cols = list(zip(*per.values(), strict=True))
    return {"per_seed": per, "best_baseline": best, "mean": [spread(c)["mean"] for c in cols],
            "min": [min(c) for c in cols], "max": [max(c) for c in cols],
            "average": spread(sum(v) / len(v) for v in per.values())}


def _composition(per_seed: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    insts = sorted({i for c in per_seed for i in c})
    return {i: {k: spread(c.get(i, {}).get(k, 0.0) for c in per_seed) for k in ("share", "on_time_share")}
            for i in insts}


def _prediction(per_seed: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    insts = sorted({i for c in per_seed for i in c})
    out = {}
    for i in insts:
        vals = [c[i] for c in per_seed if i in c and c[i]["n"]]
        out[i] = ({"mape": spread(v["mape"] for v in vals), "median_rel_error": spread(v["median_rel_error"] for v in vals),
                   "n": sum(v["n"] for v in vals)} if vals else {"n": 0})
    return out


# ------------------------------------------------------------------------------------- delta
def delta_experiment(rate: float = PAPER_RATE) -> Experiment:
    points = ["bear", "bear+ext", *baselines()]

    def cells(seeds: Sequence[int]) -> list[Cell]:
        return ([cell("bear-lagrange", rate, s, {"delta": d}) for s in seeds for d in DELTAS]
                + [cell(n, rate, s) for s in seeds for n in points])

    def result(res: Results, seeds: Sequence[int]) -> dict[str, Any]:
        def pt(cs: list[Cell]) -> dict[str, Any]:
            return {m: spread(res[c][m] for c in cs) for m in ("mean_utility", "mean_ttft_s", "on_time_utility")}

        return {"rate": rate, "seeds": list(seeds), "entries": _labels(points),
                "lagrange": [{"delta": d, **pt([cell("bear-lagrange", rate, s, {"delta": d}) for s in seeds])}
                             for d in DELTAS],
                "points": {n: pt([cell(n, rate, s) for s in seeds]) for n in points}}

    return Experiment("delta", "Fig. 9", cells, result)


# ------------------------------------------------------------------------------------- staleness
STALENESS_RATES = [PAPER_RATE, 6.0]  # the paper's 8 q/s, and a rate this pool serves without collapse


def staleness_experiment(rates: Sequence[float] = STALENESS_RATES) -> Experiment:
    names = ["bear", "bear+ext"]

    def row(n: str, rate: float) -> Callable[[int], list[Cell]]:
        return lambda s: [cell(n, rate, s, delay_s=d, max_age_s=STALE_MAX_AGE_S) for d in DELAYS]

    def cells(seeds: Sequence[int]) -> list[Cell]:
        return [c for s in seeds for r in rates for n in names for c in row(n, r)(s)]

    def result(res: Results, seeds: Sequence[int]) -> dict[str, Any]:
        out: dict[str, Any] = {"rates": list(rates), "delays_s": DELAYS, "seeds": list(seeds),
                               "entries": _labels(names), "paper": {"drop_at_1s": PAPER["staleness_drop_at_1s"]},
                               "on_time_utility": {}, "drop_vs_zero_delay": {}}
        for r in rates:
            table = {n: _per_seed(res, seeds, row(n, r), "on_time_utility") for n in names}
            out["on_time_utility"][str(r)] = table
            out["drop_vs_zero_delay"][str(r)] = {
                n: [spread(1.0 - v[k] / v[0] for v in table[n]["per_seed"].values()) for k in range(len(DELAYS))]
                for n in names}
        return out

    return Experiment("staleness", "Fig. 14", cells, result)


# ------------------------------------------------------------------------------------- lambda
def lambda_experiment(rates: Sequence[float] = PAPER_RATES) -> Experiment:
    names = ["bear", "latency-agnostic"]  # the paper's Fig. 17 compares these two

    def cells(seeds: Sequence[int]) -> list[Cell]:
        return [cell(n, r, s, lam=lam) for s in seeds for n in names for r in rates for lam in LAMBDAS]

    def result(res: Results, seeds: Sequence[int]) -> dict[str, Any]:
        return {"rates": list(rates), "lambdas": LAMBDAS, "seeds": list(seeds), "entries": _labels(names),
                "on_time_utility": {n: {str(r): _per_seed(res, seeds, lambda s, n=n, r=r: [
                    cell(n, r, s, lam=lam) for lam in LAMBDAS], "on_time_utility") for r in rates} for n in names}}

    return Experiment("lambda", "Fig. 17", cells, result, multi_seed=False)


# ------------------------------------------------------------------------------------- bursty
def bursty_experiment() -> Experiment:
    names = ["bear", "bear+ext", *baselines()]

    def row(n: str, ratio: float) -> Callable[[int], list[Cell]]:
        return lambda s: [cell(n, r, s, arrivals="mmpp", ratio=ratio) for r in BURSTY_RATES]

    def cells(seeds: Sequence[int]) -> list[Cell]:
        return [c for s in seeds for n in names for ratio in BURST_RATIOS for c in row(n, ratio)(s)]

    def result(res: Results, seeds: Sequence[int]) -> dict[str, Any]:
        return {"rates": BURSTY_RATES, "seeds": list(seeds), "entries": _labels(names),
                "on_time_utility": {f"r={int(ratio)}": {n: _per_seed(res, seeds, row(n, ratio), "on_time_utility")
                                                        for n in names} for ratio in BURST_RATIOS}}

    return Experiment("bursty", "Fig. 10", cells, result, multi_seed=False)


# ------------------------------------------------------------------------------------- sensitivity
# The sensitivity study runs BEAR, the eq. 8 ablation and the two baselines that were the best
# baseline in every cell of the rates experiment (SCORE, RouteBalance).
SENSITIVITY_ENTRIES = ["bear", "bear+ext", "prefill-throughput", "score", "routebalance"]


def sensitivity_experiment(rates: Sequence[float] = SENSITIVITY_RATES) -> Experiment:
    names = SENSITIVITY_ENTRIES
    variants = ["", *(v.name for v in SENSITIVITY)]

    def cells(seeds: Sequence[int]) -> list[Cell]:
        return [cell(n, r, s, variant=v) for s in seeds for v in variants for n in names for r in rates]

    def result(res: Results, seeds: Sequence[int]) -> dict[str, Any]:
        out: dict[str, Any] = {"rates": list(rates), "seeds": list(seeds), "entries": _labels(names),
                               "variants": {}}
        base = [n for n in names if n in baselines()]
        for v in variants:
            table = {n: [sum(res[cell(n, r, s, variant=v)]["on_time_utility"] for s in seeds) / len(seeds)
                         for r in rates] for n in names}
            out["variants"][v or "as set"] = {
                "on_time_utility": table, "best_baseline": best_baseline(table, base),
                "gain_bear": gain_over_best(table, "bear", base), "gain_bear+ext": gain_over_best(table, "bear+ext", base),
                "estimator_gain": gain_over_best(table, "bear", ["prefill-throughput"]),
                "composition_bear": [res[cell("bear", r, seeds[0], variant=v)]["composition"] for r in rates],
                "slo_bear": [res[cell("bear", r, seeds[0], variant=v)]["slo_attainment"] for r in rates]}
        return out

    return Experiment("sensitivity", "sensitivity study", cells, result, multi_seed=False)


def highload_experiment(names: Sequence[str] | None = None, arrivals: Mapping[str, Any] | None = None) -> Experiment:
    e = rates_experiment(rates=HIGH_LOAD_RATES, names=names, name="highload", figure="high-load sensitivity",
                         arrivals=arrivals)
    return Experiment(e.name, e.figure, e.cells, e.result, multi_seed=False)


def tune_experiment() -> Experiment:
    """The grid of comparison.json's tuning section on its seed: the OnTimeUtility of every
    configuration of RouteBalance and SCORE at the tuning rates."""
    cfg = load_config()["tuning"]
    rates = cfg["rates"]

    def combos() -> list[tuple[str, dict[str, float]]]:
        out = []
        for name, grid in cfg["grid"].items():
            keys = sorted(grid)
            stack: list[dict[str, float]] = [{}]
            for k in keys:
                stack = [{**d, k: float(v)} for d in stack for v in grid[k]]
            out += [(name, d) for d in stack]
        return out

    def cells(seeds: Sequence[int]) -> list[Cell]:
        return [cell(n, r, s, p) for s in seeds for n, p in combos() for r in rates]

    def result(res: Results, seeds: Sequence[int]) -> dict[str, Any]:
        scores = []
        for n, p in combos():
            vals = [sum(res[cell(n, r, s, p)]["on_time_utility"] for s in seeds) / len(seeds) for r in rates]
            scores.append({"entry": n, "params": p, "on_time_utility": vals, "mean": sum(vals) / len(vals)})
        best = {n: max((x for x in scores if x["entry"] == n), key=lambda x: x["mean"]) for n in cfg["grid"]}
        return {"seeds": list(seeds), "rates": rates, "objective": cfg["objective"], "scores": scores,
                "chosen": {n: b["params"] for n, b in best.items()}}

    return Experiment("tune", "baseline tuning (§5.3)", cells, result, multi_seed=False)


# ------------------------------------------------------------------------------------- prefix
def prefix_experiment(rates: Sequence[float] | None = None, policies: Sequence[str] | None = None) -> Experiment:
    """Multi-turn sessions with prefix caching on (``bear.evaluation.prefix``, docs/prefix.md): its
    own cells (sessions, not the query stream), run in the same pool on the seed's setup.
    ``policies``: registry names to keep (``bear`` keeps ``bear-nohits`` too)."""
    from dataclasses import asdict

    from bear.evaluation.prefix import PREFIX_POLICIES, PREFIX_RATES, prefix_cells, prefix_result
    from bear.evaluation.prefix_workload import ChatStats

    xs = list(rates or PREFIX_RATES)
    pol = [p for p in PREFIX_POLICIES if policies is None or ("bear" if p == "bear-nohits" else p) in policies]

    def cells(seeds: Sequence[int]) -> list[Any]:
        return [c for s in seeds for c in prefix_cells(xs, pol, s)]

    def result(res: Results, seeds: Sequence[int]) -> dict[str, Any]:
        return {"seeds": list(seeds[:1]), **prefix_result(xs, pol, res, seeds[0]), "workload": asdict(ChatStats())}

    return Experiment("prefix", "prefix caching (docs/prefix.md)", cells, result, multi_seed=False)


# ------------------------------------------------------------------------------------- herd, reliability
# Bursty arrivals beyond the paper's MMPP (issue 39): batches of HERD_BATCH queries at one instant,
# the batch instants Poisson at rate / HERD_BATCH, at the paper's rates. 20 is, compressed into one
# instant, about the excess arrivals of one high-state sojourn of the paper's r = 3 MMPP at 8 q/s
# ((17.14 − 8) q/s × 2.5 s ≈ 23; App. B, Table 3). Set before any result was looked at.
HERD_BATCH = 20
SHIPPED = "bear+overflow"  # BEAR as the live router runs it by default
# the arrival settings the reliability experiment measures on: Poisson, the paper's MMPP (r = 3),
# the batches above
RELIABILITY_ARRIVALS: dict[str, dict[str, Any]] = {
    "poisson": {}, "mmpp-r3": {"arrivals": "mmpp", "ratio": 3.0},
    f"batch-{HERD_BATCH}": {"arrivals": "batch", "batch_size": HERD_BATCH}}
RELIABILITY_ENTRIES = [SHIPPED, "bear+confidence"]


def herd_experiment(rates: Sequence[float] = PAPER_RATES, batch: int = HERD_BATCH) -> Experiment:
    """Batches of ``batch`` queries at one instant: BEAR as shipped and every baseline with
    decisions sequenced (each sees the ones before it: the live router since issue 39), and the
    routers that read the estimator again with the decisions of a batch made concurrently (none sees
    another: the live herd before)."""
    seq = [SHIPPED, "bear+confidence", *baselines()]
    conc = [n for n in seq if _reads_estimator(n)]
    modes = {"sequenced": (seq, {"arrivals": "batch", "batch_size": batch}),
             "concurrent": (conc, {"arrivals": "batch", "batch_size": batch, "decisions": "concurrent"})}
    inner = {m: rates_experiment(rates, ns, name=f"herd-{m}", arrivals=kw) for m, (ns, kw) in modes.items()}

    def cells(seeds: Sequence[int]) -> list[Cell]:
        return [c for e in inner.values() for c in e.cells(seeds)]

    def result(res: Results, seeds: Sequence[int]) -> dict[str, Any]:
        out: dict[str, Any] = {"rates": list(rates), "seeds": list(seeds), "batch_size": batch,
                               "entries": _labels(seq), "modes": {}}
        for m, e in inner.items():
            r = e.result(res, seeds)
            out["modes"][m] = {k: r[k] for k in ("on_time_utility", "slo_attainment", "gains", "composition",
                                                 "ttft_prediction", "reliability") if k in r}
        return out

    return Experiment("herd", "beyond the paper: the herd (issue 39)", cells, result)


def fleet_experiment() -> Experiment:
    """Pools of 16, 64 and 256 instances (``bear.evaluation.fleet``): BEAR with candidate
    selection against BEAR with every instance a candidate and the baselines."""
    from bear.evaluation.fleet import fleet_cells, fleet_result

    return Experiment("fleet", "beyond the paper: fleet scale (issue 45)", fleet_cells,  # type: ignore[arg-type]
                      fleet_result, multi_seed=False)


def _reads_estimator(name: str) -> bool:
    from bear.router.policies import make_policy

    e = entries()[name]
    return bool(make_policy(e.policy, **dict(e.params)).needs_estimate)


def reliability_experiment(rates: Sequence[float] = PAPER_RATES) -> Experiment:
    """Is feasible likely on time: BEAR as shipped (the point test) and at the confidence level of
    ``bear+confidence``, on each arrival setting of RELIABILITY_ARRIVALS; the on-time share among the
    queries marked feasible per seed and rate, and the reliability curve (predicted P of the chosen
    instance, binned, against the observed on-time share)."""
    inner = {a: rates_experiment(rates, RELIABILITY_ENTRIES, name=f"reliability-{a}", arrivals=kw)
             for a, kw in RELIABILITY_ARRIVALS.items()}

    def cells(seeds: Sequence[int]) -> list[Cell]:
        return [c for e in inner.values() for c in e.cells(seeds)]

    def result(res: Results, seeds: Sequence[int]) -> dict[str, Any]:
        out: dict[str, Any] = {"rates": list(rates), "seeds": list(seeds), "entries": _labels(RELIABILITY_ENTRIES),
                               "arrivals": {}}
        for a, e in inner.items():
            r = e.result(res, seeds)
            out["arrivals"][a] = {k: r[k] for k in ("on_time_utility", "slo_attainment", "reliability")}
        return out

    return Experiment("reliability", "beyond the paper: P(on time) calibrated (issue 39)", cells, result)


# the experiments that take --rates and --policies
SELECTABLE = ("rates", "estimator", "accuracy", "highload", "prefix")


def selectable(rates: Sequence[float] | None = None, policies: Sequence[str] | None = None,
               arrivals: Mapping[str, Any] | None = None) -> dict[str, Experiment]:
    """The experiments of ``SELECTABLE`` for these rates (default: each one's own) and only the
    comparison entries whose policy is in ``policies`` (default: all); ``arrivals``: the rates
    experiments' arrival settings (``rates_experiment``)."""
    def keep(ns: Sequence[str]) -> list[str]:
        return [n for n in ns if policies is None or entries()[n].policy in policies]

    high = highload_experiment(keep(rate_entries()), arrivals)
    return {
        "rates": rates_experiment(rates=rates or PAPER_RATES, names=keep(rate_entries()), arrivals=arrivals),
        "estimator": rates_experiment(rates=rates or PAPER_RATES, names=keep(["bear", "bear+ext", "prefill-throughput"]),
                                      name="estimator", figure="Fig. 16", arrivals=arrivals),
        "accuracy": rates_experiment(rates=[PAPER_RATE], names=keep(rate_entries()), name="accuracy", figure="Fig. 19",
                                     arrivals=arrivals),
        "highload": high,
        "prefix": prefix_experiment(rates=rates, policies=policies)}


def registry(rates: Sequence[float] | None = None, policies: Sequence[str] | None = None,
             arrivals: Mapping[str, Any] | None = None) -> dict[str, Experiment]:
    """Every experiment by name; ``rates``, ``policies`` and ``arrivals`` apply to those of
    ``SELECTABLE`` (``rates`` also to ``herd`` and ``reliability``)."""
    sel = selectable(rates, policies, arrivals)
    return {e.name: e for e in (
        sel["rates"], sel["estimator"], sel["accuracy"],
        delta_experiment(), staleness_experiment(), lambda_experiment(), bursty_experiment(),
        sensitivity_experiment(), sel["highload"], sel["prefix"],
        tune_experiment(), herd_experiment(rates or PAPER_RATES), reliability_experiment(rates or PAPER_RATES),
        fleet_experiment())}
