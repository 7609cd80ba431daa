"""The generated summary page of a ``bear eval`` run (``summary.md``): every experiment's table
(mean and range over seeds), the paper's number beside ours, and links to the figures."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any

from bear.evaluation import decomposition
from bear.evaluation.plots import accuracy_index
from bear.predictor.synth import OUTPUT_LENGTHS, PROMPT_LENGTHS


def _f(x: float | None, nd: int = 3) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.{nd}f}"


def _pct(x: float | None, nd: int = 1) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x * 100:+.{nd}f} %"


def _mr(stat: dict[str, Any], k: int, nd: int = 3) -> str:
    """mean [min–max] of position k."""
    if len(stat.get("per_seed", {})) > 1:
        return f"{_f(stat['mean'][k], nd)} [{_f(stat['min'][k], nd)}–{_f(stat['max'][k], nd)}]"
    return _f(stat["mean"][k], nd)


def _mr_pct(stat: dict[str, Any], k: int) -> str:
    if len(stat.get("per_seed", {})) > 1:
        return f"{_pct(stat['mean'][k])} [{_pct(stat['min'][k])}, {_pct(stat['max'][k])}]"
    return _pct(stat["mean"][k])


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _figs(r: dict[str, Any]) -> list[str]:
    return [f"![{f}]({f})" for f in r.get("files", [])]


def rates_section(r: dict[str, Any], title: str) -> list[str]:
    xs = r["rates"]
    lines = [f"## {title} ({r['figure']}; seeds {', '.join(map(str, r['seeds']))})", "",
             "OnTimeUtility (eq. 6), mean [range] over seeds:", ""]
    rows = [[("**" + n + "**") if r["entries"][n]["role"] == "ours" else n, *(_mr(v, k) for k in range(len(xs)))]
            for n, v in r["on_time_utility"].items()]
    lines += _table(["router", *(f"{x:g} q/s" for x in xs)], rows)
    for ours, g in r.get("gains", {}).items():
        avg = g["average"]
        best = {s: ", ".join(b) for s, b in g["best_baseline"].items()}
        lines += ["", f"**{ours}** vs the best baseline per rate: " + ", ".join(_mr_pct(g, k) for k in range(len(xs)))
                  + f"; average {_pct(avg['mean'])} [{_pct(avg['min'])}, {_pct(avg['max'])}]"
                  + f" (the paper: {_pct(r['paper']['gain_over_best_baseline'])}). Best baseline per seed: "
                  + "; ".join(f"{s}: {b}" for s, b in best.items()) + "."]
    for ours, g in r.get("gains_over_routebalance_score", {}).items():
        avg = g["average"]
        lines += ["", f"**{ours}** vs the better of RouteBalance and SCORE: average {_pct(avg['mean'])} "
                  f"[{_pct(avg['min'])}, {_pct(avg['max'])}], at {xs[-1]:g} q/s {_mr_pct(g, len(xs) - 1)} "
                  f"(the paper: {_pct(r['paper']['gain_over_routebalance_score'])} on average, "
                  f"{_pct(r['paper']['max_gain_over_routebalance_score'])} at 8.9 q/s, over each of them)."]
    for ours, g in r.get("estimator_gain", {}).items():
        lines += ["", f"**{ours}** vs the same rule on the eq. 8 estimate (Fig. 16): "
                  + ", ".join(_mr_pct(g, k) for k in range(len(xs))) + "."]
    lines += ["", "SLO attainment (Fig. 18):", ""]
    lines += _table(["router", *(f"{x:g}" for x in xs)],
                    [[n, *(_mr(v, k, 3) for k in range(len(xs)))] for n, v in r["slo_attainment"].items()])
    if r.get("composition"):
        lines += ["", "Routing composition (Fig. 1): share of queries per instance (share of those on time), mean over seeds:", ""]
        rows = []
        for n, per in r["composition"].items():
            for inst in sorted({i for c in per for i in c}):
                rows.append([n, inst, *(f"{_f(c.get(inst, {}).get('share', {}).get('mean'), 2)} "
                                        f"({_f(c.get(inst, {}).get('on_time_share', {}).get('mean'), 2)})" for c in per)])
        lines += _table(["router", "instance", *(f"{x:g}" for x in xs)], rows)
    k = accuracy_index(xs)
    lines += ["", f"Latency-estimate MAPE per instance at {xs[k]:g} q/s (Fig. 19), mean over seeds:", ""]
    rows = []
    insts = sorted({i for per in r["ttft_prediction_by_instance"].values() for i in per[k]})
    for n, per in r["ttft_prediction_by_instance"].items():
        v = per[k]
        if any(x.get("n") for x in v.values()):
            rows.append([n, *(f"{_f(v[i]['mape']['mean'] * 100, 0)} %" if v.get(i, {}).get("n") else "–"
                              for i in insts)])
    if rows:
        lines += _table(["router", *insts], rows)
    if r.get("ttft_prediction_learned"):
        lines += ["", "TTFT MAPE of the chosen instance, mean over seeds: each router's own estimate, and the learned "
                      "predictor (`bear.evaluation.learned`, trained online on the run's observed TTFTs) with the "
                      "router's estimate on the same queries (own / learned):", ""]
        rows = [[n, *(f"{_f(r['ttft_prediction_same_queries'][n][j]['mean'] * 100, 1)} / "
                      f"{_f(v[j]['mean'] * 100, 1)} %" for j in range(len(xs)))]
                for n, v in r["ttft_prediction_learned"].items()]
        lines += _table(["router", *(f"{x:g}" for x in xs)], rows)
    return [*lines, "", *_figs(r), ""]


def delta_section(r: dict[str, Any]) -> list[str]:
    lines = [f"## Utility–latency trade-off ({r['figure']}, {r['rate']:g} q/s)", ""]
    rows = [[f"BEAR eq. 7, δ = {c['delta']:g}", _f(c["mean_utility"]["mean"]), _f(c["mean_ttft_s"]["mean"] * 1e3, 0),
             _f(c["on_time_utility"]["mean"])] for c in r["lagrange"]]
    rows += [[n, _f(p["mean_utility"]["mean"]), _f(p["mean_ttft_s"]["mean"] * 1e3, 0), _f(p["on_time_utility"]["mean"])]
             for n, p in r["points"].items()]
    lines += _table(["router", "mean utility", "mean TTFT (ms)", "OnTimeUtility"], rows)
    return [*lines, "", *_figs(r), ""]


def staleness_section(r: dict[str, Any]) -> list[str]:
    lines = [f"## Stale snapshots ({r['figure']})", ""]
    rows = []
    for rate, table in r["on_time_utility"].items():
        rows += [[f"{float(rate):g}", n, *(_mr(v, k) for k in range(len(r["delays_s"])))] for n, v in table.items()]
        rows += [[f"{float(rate):g}", f"{n}: change vs 0 ms", *(_pct(-d["mean"]) for d in drops)]
                 for n, drops in r["drop_vs_zero_delay"][rate].items()]
    lines += _table(["q/s", "router", *(f"{d * 1e3:g} ms" for d in r["delays_s"])], rows)
    lines += ["", f"The paper: close to the zero-delay value up to 400 ms, −{r['paper']['drop_at_1s'] * 100:.0f} % at 1 s."]
    return [*lines, "", *_figs(r), ""]


def lambda_section(r: dict[str, Any]) -> list[str]:
    lines = [f"## λ ({r['figure']})", ""]
    rows = []
    for n, per_rate in r["on_time_utility"].items():
        for rate, v in per_rate.items():
            rows.append([n, rate, *(_mr(v, k) for k in range(len(r["lambdas"])))])
    lines += _table(["router", "q/s", *(f"λ={x:g}" for x in r["lambdas"])], rows)
    return [*lines, "", *_figs(r), ""]


def bursty_section(r: dict[str, Any]) -> list[str]:
    lines = [f"## Bursty arrivals ({r['figure']})", ""]
    rows = [[panel, n, *(_mr(v, k) for k in range(len(r["rates"])))]
            for panel, table in r["on_time_utility"].items() for n, v in table.items()]
    lines += _table(["MMPP-2", "router", *(f"{x:g} q/s" for x in r["rates"])], rows)
    return [*lines, "", *_figs(r), ""]


def sensitivity_section(r: dict[str, Any]) -> list[str]:
    xs = r["rates"]
    lines = [f"## Sensitivity to the instance assumptions (seed {r['seeds'][0]})", "",
             "OnTimeUtility of BEAR, BEAR+ext and the best baseline; BEAR's gain over it; BEA vs eq. 8:", ""]
    rows = []
    for v, d in r["variants"].items():
        t = d["on_time_utility"]
        for k, x in enumerate(xs):
            b = d["best_baseline"][k]
            rows.append([v, f"{x:g}", _f(t["bear"][k]), _f(t["bear+ext"][k]), f"{_f(t[b][k])} ({b})",
                         _pct(d["gain_bear"][k]), _pct(d["gain_bear+ext"][k]), _pct(d["estimator_gain"][k]),
                         _f(d["slo_bear"][k], 2)])
    lines += _table(["variant", "q/s", "bear", "bear+ext", "best baseline", "bear gain", "bear+ext gain",
                     "BEA vs eq. 8", "bear SLO"], rows)
    return [*lines, "", *_figs(r), ""]


def lps_section(r: dict[str, Any]) -> list[str]:
    lines = [f"## LPS model vs measured delay ({r['figure']}, {r['instance']} alone)", "",
             f"Saturation: μ = {r['mu_qps']:.2f} q/s, mean concurrency {r['saturation_concurrency']:.1f} → k = {r['k']} "
             f"(the paper: k = {r['paper']['k']}, measured {r['paper']['concurrency']} active sequences). "
             f"θ = {r['theta']:.0f} tok/s.", ""]
    rows = [[_f(p["alpha_qps"], 2), _f(p["load"], 2), _f(p["measured_mean_ttft_s"] * 1e3, 0),
             _f(p["lps_mean_ttft_s"] * 1e3, 0), _f(p["measured_concurrency"], 1)] for p in r["points"]]
    lines += _table(["α (q/s)", "α/μ", "measured mean TTFT (ms)", "LPS eq. 14 (ms)", "mean concurrency"], rows)
    return [*lines, "", *_figs(r), ""]


def estimates_section(r: dict[str, Any]) -> list[str]:
    p = r["paper"]
    lines = [f"## Estimators vs observed ({r['figure']}, each instance alone at 60 % of its saturation rate)", ""]
    rows = [[i["instance"], _f(i["alpha_qps"], 2), f"{i['bea']['mape'] * 100:.1f} %", f"{i['bea+ext']['mape'] * 100:.1f} %",
             f"{i['eq8']['mape'] * 100:.1f} %", _pct(i["eq8"]["median_rel_error"], 0), f"{i['batch']['mape'] * 100:.1f} %"]
            for i in r["instances"]]
    lines += _table(["instance", "q/s", "BEA MAPE", "BEA+ext MAPE", "eq. 8 MAPE", "eq. 8 median error",
                     "eq. 12 batch-time MAPE"], rows)
    lines += ["", f"The paper (Qwen3-0.6B on one H100): BEA {p['bea_mape'] * 100:.0f} %, eq. 8 {p['eq8_mape'] * 100:.0f} %, "
              f"eq. 12 {p['eq12_mape'] * 100:.0f} %."]
    if all("learned" in i for i in r["instances"]):
        lines += ["", "The learned predictor (gradient-boosted trees on queue features, trained online on the run's "
                      "observed TTFTs: `bear.evaluation.learned`), and every estimator on the queries it predicts "
                      "(it needs observations first):", ""]
        rows = [[i["instance"], str(i["learned"]["n"]), f"{i['learned']['mape'] * 100:.1f} %",
                 *(f"{i['same_queries'][k] * 100:.1f} %" for k in ("bea", "bea+ext", "eq8"))] for i in r["instances"]]
        lines += _table(["instance", "queries", "learned MAPE", "BEA there", "BEA+ext there", "eq. 8 there"], rows)
    return [*lines, "", *_figs(r), ""]


def workload_section(r: dict[str, Any]) -> list[str]:
    lines = [f"## Workload ({r['figure']}, seed {r['seed']})", ""]
    rows = []
    for t, mean in r["prompt_mean"].items():
        outs = r["output_mean"][t]
        rows.append([t, str(r["n"][t]), f"{mean:,.0f}", f"{PROMPT_LENGTHS[t].mean:,.0f}",
                     " / ".join(f"{v:,.0f}" for v in outs.values()), f"{OUTPUT_LENGTHS[t].mean:,.0f}"])
    lines += _table(["task", "queries", "prompt mean", "source", "response mean (" + " / ".join(
        next(iter(r["output_mean"].values()))) + ")", "source (8B)"], rows)
    return [*lines, "", *_figs(r), ""]


def diagnose_section(r: dict[str, Any]) -> list[str]:
    lines = [f"## Diagnosis: BEA and eq. 8 on the same states (seed {r['seed']})", "",
             "Every decision of a run traced with both estimates of every candidate. On the chosen instance: "
             "share of queries each estimator called feasible that were late (false feasible) and called infeasible "
             "that were on time (false infeasible); share of queries whose feasible sets (over all instances) differ between the two; how often the eq. 8 rule would have picked the same instance; "
             "share with no instance predicted feasible; on-time queries with negative utility.", ""]
    rows = []
    for x in r["runs"]:
        cf = x["confusion"]
        rows.append([x["entry"], f"{x['rate']:g}", _f(cf["bea"].get("feasible/late", 0), 3),
                     _f(cf["bea"].get("infeasible/on time", 0), 3), _f(cf["eq8"].get("feasible/late", 0), 3),
                     _f(cf["eq8"].get("infeasible/on time", 0), 3), _f(x["feasible_sets_differ"], 3), _f(x["eq8_rule_agrees"], 3),
                     _f(x["none_feasible"]["bea"], 3), _f(x["none_feasible"]["eq8"], 3),
                     _f(x["on_time_negative_utility_share"], 3), _f(x["on_time_negative_utility_sum_per_query"], 4)])
    lines += _table(["run", "q/s", "BEA false feasible", "BEA false infeasible", "eq. 8 false feasible",
                     "eq. 8 false infeasible", "feasible sets differ", "eq. 8 rule same pick", "none feasible (BEA)", "none feasible (eq. 8)",
                     "on time, utility < 0", "their utility / query"], rows)
    lines += ["", "KV cache in use at the decisions (mean; share of decisions with ≥ 95 % in use):", ""]
    insts = sorted(r["runs"][0]["kv_use"])
    lines += _table(["run", "q/s", *insts], [[x["entry"], f"{x['rate']:g}", *(
        f"{x['kv_use'][i]['mean']:.2f} ({x['kv_use'][i]['share_above_95']:.2f})" for i in insts)] for x in r["runs"]])
    lines += ["", "Per quarter of each run (in arrival order): share on time; median predicted / observed TTFT of "
              "the chosen instance (s):", ""]
    lines += _table(["run", "q/s", "1st", "2nd", "3rd", "4th"], [[x["entry"], f"{x['rate']:g}", *(
        f"{q['on_time']:.2f}; {q['median_predicted_s']:.3f} / {q['median_observed_s']:.3f}" for q in x["by_quarter"])]
        for x in r["runs"]])
    lines += ["", "Per task (share of queries per instance; share on time; mean utility of the on-time ones):", ""]
    rows = []
    for x in r["runs"]:
        for t, d in x["by_task"].items():
            rows.append([x["entry"], f"{x['rate']:g}", t, ", ".join(f"{k}: {v:.2f}" for k, v in d["share"].items()),
                         _f(d["on_time"], 2), _f(d["mean_utility_on_time"], 3)])
    lines += _table(["run", "q/s", "task", "routed to", "on time", "utility (on time)"], rows)
    return [*lines, ""]


SECTIONS = {"rates": lambda r: rates_section(r, "OnTimeUtility at the paper's arrival rates"),
            "estimator": lambda r: rates_section(r, "Estimator ablation"),
            "accuracy": lambda r: rates_section(r, "Latency-estimate accuracy"),
            "highload": lambda r: rates_section(r, "Beyond the paper's rates (sensitivity)"),
            "delta": delta_section, "staleness": staleness_section, "lambda": lambda_section,
            "bursty": bursty_section, "sensitivity": sensitivity_section, "lps": lps_section,
            "estimates": estimates_section, "workload": workload_section, "diagnose": diagnose_section,
            "decomposition": lambda r: [*decomposition.table(r), ""]}


def write_summary(results: dict[str, dict[str, Any]], out: Path, wall_s: float, workers: int) -> Path:
    first = next(iter(results.values()))
    lines = ["# bear eval — summary (generated)", "",
             f"Generated {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')} by `bear eval`; {first['n_queries']} "
             f"queries per run; wall time {wall_s / 60:.1f} min with {workers} worker processes. "
             "Every number is the simulated pool of docs/evaluation.md; ranges are over seeds.", ""]
    for name in ("rates", "estimator", "accuracy", "delta", "staleness", "lambda", "bursty", "lps", "estimates",
                 "decomposition", "workload", "diagnose", "sensitivity", "highload", "tune"):
        if name in results and name in SECTIONS:
            lines += SECTIONS[name](results[name])
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
