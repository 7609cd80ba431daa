"""PNG figures for ``bear eval`` (matplotlib, headless): each takes an experiment's result and
the output folder, writes its figure(s) and returns their file names. Lines are the mean over
seeds, bands their range."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

STYLE: dict[str, dict[str, Any]] = {
    "bear": dict(color="black", linewidth=2.4, marker="o"),
    "bear+ext": dict(color="tab:red", linewidth=2.0, marker="s", linestyle="--"),
    "bear+overflow": dict(color="tab:green", linewidth=2.0, marker="D", linestyle="-."),
    "prefill-throughput": dict(color="tab:gray", linewidth=1.6, marker="^", linestyle=":"),
}


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _band(ax: Any, xs: list[float], stat: dict[str, Any], name: str, label: str | None = None) -> None:
    style = STYLE.get(name, dict(marker=".", linewidth=1.2))
    line = ax.plot(xs, stat["mean"], label=label or name, **style)[0]
    if len(stat.get("per_seed", {})) > 1:
        ax.fill_between(xs, stat["min"], stat["max"], color=line.get_color(), alpha=0.15)


def _lines(ax: Any, xs: list[float], table: dict[str, dict[str, Any]]) -> None:
    for name, stat in table.items():
        _band(ax, xs, stat, name)


def rates(result: dict[str, Any], out: Path, stem: str = "rates") -> list[str]:
    files = []
    xs = result["rates"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    _lines(ax, xs, result["on_time_utility"])
    ax.set(xlabel="arrival rate (queries/s)", ylabel="OnTimeUtility (eq. 6)",
           title=f"OnTimeUtility vs load (Fig. 8), {len(result['seeds'])} seeds")
    ax.legend(fontsize=7)
    files.append(_save(fig, out / f"{stem}.png"))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    _lines(ax, xs, result["slo_attainment"])
    ax.set(xlabel="arrival rate (queries/s)", ylabel="share of TTFT targets met", title="SLO attainment (Fig. 18)")
    ax.legend(fontsize=7)
    files.append(_save(fig, out / f"{stem}-slo.png"))
    if result.get("composition"):
        files.append(composition(result, out / f"{stem}-composition.png"))
    if result.get("estimator_gain"):
        files.append(estimator(result, out / f"{stem}-estimator.png"))
    files.append(accuracy(result, out / f"{stem}-accuracy.png"))
    return files


def composition(result: dict[str, Any], path: Path) -> str:
    comp = result["composition"]
    xs = result["rates"]
    fig, axes = plt.subplots(1, len(comp), figsize=(3.6 * len(comp), 4.2), sharey=True)
    axes = np.atleast_1d(axes)
    insts = sorted({i for per in comp.values() for c in per for i in c})
    colors = dict(zip(insts, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, (name, per) in zip(axes, comp.items(), strict=True):
        bottom = np.zeros(len(xs))
        x = np.arange(len(xs))
        for inst in insts:
            share = np.array([c.get(inst, {}).get("share", {}).get("mean", 0.0) for c in per])
            met = share * np.array([c.get(inst, {}).get("on_time_share", {}).get("mean", 0.0) for c in per])
            ax.bar(x, met, bottom=bottom, color=colors[inst], label=inst)
            ax.bar(x, share - met, bottom=bottom + met, color=colors[inst], hatch="//", alpha=0.45)
            bottom += share
        ax.set_xticks(x, [f"{r:g}" for r in xs])
        ax.set(title=name, xlabel="q/s")
    axes[0].set_ylabel("share of queries (hatched: target missed)")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("Routing composition (Fig. 1)")
    return _save(fig, path)


def estimator(result: dict[str, Any], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = result["rates"]
    for name in ("bear", "bear+ext", "prefill-throughput"):
        if name in result["on_time_utility"]:
            _band(ax, xs, result["on_time_utility"][name], name)
    ax.set(xlabel="arrival rate (queries/s)", ylabel="OnTimeUtility",
           title="BEA vs the prefill-throughput estimate under the BEAR rule (Fig. 16)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def accuracy(result: dict[str, Any], path: Path) -> str:
    """Fig. 19: MAPE of each router's latency estimate against the observed TTFT, per model
    instance, at 8 q/s if run (the paper's operating point), else the highest rate run."""
    k = accuracy_index(result["rates"])
    per = {n: v[k] for n, v in result["ttft_prediction_by_instance"].items()
           if any(x.get("n") for x in v[k].values())}
    insts = sorted({i for v in per.values() for i in v})
    fig, ax = plt.subplots(figsize=(9, 4.6))
    width = 0.8 / max(1, len(insts))
    for j, inst in enumerate(insts):
        vals = [per[n].get(inst, {}).get("mape", {}).get("mean", math.nan) * 100 for n in per]
        ax.bar(np.arange(len(per)) + j * width, vals, width, label=inst)
    ax.set_xticks(np.arange(len(per)) + width * (len(insts) - 1) / 2, list(per), rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set(ylabel="MAPE vs observed TTFT (%)",
           title=f"latency estimates per model at {result['rates'][k]:g} q/s (Fig. 19)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def accuracy_index(rates_: list[float], at: float = 8.0) -> int:
    return rates_.index(at) if at in rates_ else len(rates_) - 1


def delta(result: dict[str, Any], out: Path) -> list[str]:
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    curve = result["lagrange"]
    ax.plot([c["mean_ttft_s"]["mean"] * 1e3 for c in curve], [c["mean_utility"]["mean"] for c in curve], "k-o",
            label="BEAR, eq. 7 (δ sweep)")
    for c in curve:
        ax.annotate(f"δ={c['delta']:g}", (c["mean_ttft_s"]["mean"] * 1e3, c["mean_utility"]["mean"]), fontsize=6)
    for name, p in result["points"].items():
        if math.isfinite(p["mean_ttft_s"]["mean"]):
            ax.plot(p["mean_ttft_s"]["mean"] * 1e3, p["mean_utility"]["mean"], "s", label=name)
    ax.set_xscale("log")
    ax.set(xlabel="mean TTFT (ms)", ylabel="mean utility", title=f"utility–latency trade-off at {result['rate']:g} q/s (Fig. 9)")
    ax.legend(fontsize=7)
    return [_save(fig, out / "delta.png")]


def staleness(result: dict[str, Any], out: Path) -> list[str]:
    panels = result["on_time_utility"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5))
    ms = [d * 1e3 for d in result["delays_s"]]
    for ax, (rate, table) in zip(np.atleast_1d(axes), panels.items(), strict=True):
        for name, stat in table.items():
            _band(ax, ms, stat, name)
        ax.set_xscale("symlog", linthresh=25)
        ax.set(xlabel="snapshot delay (ms)", ylabel="OnTimeUtility", title=f"stale snapshots at {float(rate):g} q/s (Fig. 14)")
        ax.legend(fontsize=8)
    return [_save(fig, out / "staleness.png")]


def prefix(result: dict[str, Any], out: Path) -> list[str]:
    """OnTimeUtility and the cached share of prompt tokens vs rate, multi-turn sessions."""
    xs = result["rates"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, vals in result["policies"].items():
        style = STYLE.get(name, dict(marker=".", linewidth=1.2))
        axes[0].plot(xs, vals, label=name, **style)
        axes[1].plot(xs, result["hit_share"][name], label=name, **style)
    axes[0].set(xlabel="arrival rate (turns/s)", ylabel="OnTimeUtility (eq. 6)",
                title="Multi-turn sessions, prefix caching on")
    axes[1].set(xlabel="arrival rate (turns/s)", ylabel="prompt tokens cached where the turn ran",
                title="Prefix-cache hit share")
    axes[0].legend(fontsize=7)
    return [_save(fig, out / "prefix.png")]


def lambdas(result: dict[str, Any], out: Path) -> list[str]:
    rates_ = result["rates"]
    fig, axes = plt.subplots(1, len(rates_), figsize=(3.4 * len(rates_), 4), sharey=True)
    for ax, r in zip(np.atleast_1d(axes), rates_, strict=True):
        for name, per_rate in result["on_time_utility"].items():
            _band(ax, result["lambdas"], per_rate[str(r)], name)
        ax.set_xscale("log")
        ax.set(title=f"{r:g} q/s", xlabel="λ")
    np.atleast_1d(axes)[0].set_ylabel("OnTimeUtility")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.suptitle("OnTimeUtility vs λ (Fig. 17)")
    return [_save(fig, out / "lambda.png")]


def bursty(result: dict[str, Any], out: Path) -> list[str]:
    panels = result["on_time_utility"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5))
    for ax, (name, table) in zip(np.atleast_1d(axes), panels.items(), strict=True):
        _lines(ax, result["rates"], table)
        ax.set(xlabel="mean arrival rate (queries/s)", ylabel="OnTimeUtility", title=f"MMPP-2 {name} (Fig. 10)")
        ax.legend(fontsize=7)
    return [_save(fig, out / "bursty.png")]


def sensitivity(result: dict[str, Any], out: Path) -> list[str]:
    variants = list(result["variants"])
    fig, axes = plt.subplots(1, len(result["rates"]), figsize=(5 * len(result["rates"]), 4.6), sharey=True)
    for k, (ax, r) in enumerate(zip(np.atleast_1d(axes), result["rates"], strict=True)):
        x = np.arange(len(variants))
        v = result["variants"]
        for j, (name, key) in enumerate([("bear", "bear"), ("bear+ext", "bear+ext"), ("best baseline", None)]):
            if key is None:
                vals = [v[n]["on_time_utility"][v[n]["best_baseline"][k]][k] for n in variants]
            else:
                vals = [v[n]["on_time_utility"][key][k] for n in variants]
            ax.bar(x + (j - 1) * 0.27, vals, 0.27, label=name)
        ax.set_xticks(x, variants, rotation=40, ha="right", fontsize=7)
        ax.set(title=f"{r:g} q/s")
    np.atleast_1d(axes)[0].set_ylabel("OnTimeUtility")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.suptitle("sensitivity to the instance assumptions")
    return [_save(fig, out / "sensitivity.png")]


def tune(result: dict[str, Any], out: Path) -> list[str]:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in sorted({s["entry"] for s in result["scores"]}):
        pts = sorted((s for s in result["scores"] if s["entry"] == name), key=lambda s: -s["mean"])
        ax.plot(range(len(pts)), [p["mean"] for p in pts], "o-", label=name)
    ax.set(xlabel="configuration (sorted)", ylabel="mean OnTimeUtility over the rates", title="baseline tuning grid")
    ax.legend()
    return [_save(fig, out / "tune.png")]


def lps(result: dict[str, Any], out: Path) -> list[str]:
    pts = result["points"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    a = [p["alpha_qps"] for p in pts]
    ax.plot(a, [p["measured_mean_ttft_s"] * 1e3 for p in pts], "ko-", label="measured (simulated instance)")
    ax.plot(a, [p["lps_mean_ttft_s"] * 1e3 for p in pts], "r--",
            label=f"LPS, eqs. 13-14 (k={result['k']}, μ={result['mu_qps']:.2f} q/s)")
    for p in pts:
        ax.annotate(f"{p['measured_concurrency']:.1f}", (p["alpha_qps"], p["measured_mean_ttft_s"] * 1e3), fontsize=7)
    ax.set_yscale("log")
    ax.set(xlabel="arrival rate (queries/s)", ylabel="mean TTFT (ms)",
           title=f"{result['instance']}: LPS vs measured (Fig. 7; labels: mean concurrency)")
    ax.legend(fontsize=8)
    return [_save(fig, out / "lps.png")]


def estimates(result: dict[str, Any], out: Path) -> list[str]:
    runs = result["instances"]
    fig, axes = plt.subplots(len(runs), 3, figsize=(13, 4 * len(runs)))
    axes = np.atleast_2d(axes)
    for row, r in zip(axes, runs, strict=True):
        obs = np.array(r["observed_s"], dtype=float) * 1e3
        for ax, key, title in zip(row, ("eq8", "bea", "bea+ext"), ("eq. 8 (prefill throughput)", "BEA (paper)",
                                                                    "BEA + extensions"), strict=True):
            pred = np.array([np.nan if v is None else v for v in r[key]["predicted_s"]], dtype=float) * 1e3
            ax.scatter(obs, pred, s=3, alpha=0.4)
            hi = np.nanmax(np.concatenate([obs, pred]))
            ax.plot([0.1, hi], [0.1, hi], "k--", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set(xlabel="observed TTFT (ms)", ylabel="predicted TTFT (ms)",
                   title=f"{r['instance']}: {title}, MAPE {r[key]['mape'] * 100:.0f}%")
    files = [_save(fig, out / "estimates.png")]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4.3))
    for ax, r in zip(np.atleast_1d(axes), runs, strict=True):
        b = r["batch"]
        ax.scatter(np.array(b["observed_s"]) * 1e3, np.array(b["predicted_s"]) * 1e3, s=2, alpha=0.3)
        hi = max(b["observed_s"]) * 1e3
        ax.plot([0.1, hi], [0.1, hi], "k--", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set(xlabel="observed batch time (ms)", ylabel="eq. 12 (ms)",
               title=f"{r['instance']}: MAPE {b['mape'] * 100:.1f}% (Fig. 5)")
    files.append(_save(fig, out / "batch-time.png"))
    return files


def workload(result: dict[str, Any], out: Path) -> list[str]:
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    bins = np.logspace(0, 5, 60)
    for task, v in result["prompt_tokens"].items():
        axes[0].hist(v, bins=bins, histtype="step", linewidth=1.6, label=task)
    axes[0].set_xscale("log")
    axes[0].set(xlabel="prompt tokens", ylabel="queries", title="prompt lengths (Fig. 12)")
    axes[0].legend(fontsize=8)
    bins = np.logspace(0, 4, 50)
    for task, per_model in result["output_tokens"].items():
        for model, v in per_model.items():
            axes[1].hist(v, bins=bins, histtype="step", label=f"{task} / {model}", linewidth=1.0)
    axes[1].set_xscale("log")
    axes[1].set(xlabel="response tokens", ylabel="queries", title="response lengths (Fig. 13)")
    axes[1].legend(fontsize=6, ncol=2)
    return [_save(fig, out / "workload.png")]


def decomposition(result: dict[str, Any], out: Path) -> list[str]:
    """TTFT MAPE of each instance alone per load, one bar per source handed over exactly."""
    runs = result["alone"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4.3), squeeze=False)
    for ax, r in zip(axes[0], runs, strict=True):
        names = list(r["points"][0]["rows"])
        width = 0.8 / len(names)
        xs = np.arange(len(r["points"]))
        for n, name in enumerate(names):
            ax.bar(xs + n * width, [p["rows"][name]["mape"] * 100 for p in r["points"]], width, label=name)
        ax.set_xticks(xs + 0.4 - width / 2, [f"{p['load']:g}" for p in r["points"]])
        ax.set(xlabel="load (α/μ)", ylabel="TTFT MAPE (%)", title=f"{r['instance']} alone")
    axes[0][0].legend(fontsize=7)
    return [_save(fig, out / "decomposition.png")]


def reliability_curves(result: dict[str, Any], out: Path) -> list[str]:
    """Predicted P(on time) of the chosen instance (binned) against the observed on-time share,
    one panel per arrival setting, one line per entry (pooled over seeds and rates); the marker
    size says how many queries a bin holds."""
    panels = result["arrivals"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 4.4), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, (name, r) in zip(axes, panels.items(), strict=True):
        ax.plot([0, 1], [0, 1], color="tab:gray", linestyle=":", linewidth=1)
        for entry, rel in r["reliability"].items():
            pts = [b for b in rel["curve"] if b["n"]]
            line = ax.plot([b["mean_p"] for b in pts], [b["on_time_share"] for b in pts], label=entry,
                           **{k: v for k, v in STYLE.get(entry, dict(marker=".")).items() if k != "marker"})[0]
            total = sum(b["n"] for b in pts) or 1
            ax.scatter([b["mean_p"] for b in pts], [b["on_time_share"] for b in pts], color=line.get_color(),
                       s=[8 + 400 * b["n"] / total for b in pts], alpha=0.7)
        ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel="predicted P(on time), chosen instance", title=name)
    axes[0].set_ylabel("observed on-time share")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"reliability of P(on time), seeds {', '.join(map(str, result['seeds']))}")
    return [_save(fig, out / "reliability.png")]


def herd(result: dict[str, Any], out: Path) -> list[str]:
    """OnTimeUtility on batch arrivals: every router sequenced (solid), and the ones that read the
    estimator with the batch's decisions concurrent (dashed)."""
    xs = result["rates"]
    fig, ax = plt.subplots(figsize=(8, 5))
    colors: dict[str, Any] = {}
    for mode, style in (("sequenced", "-"), ("concurrent", "--")):
        for name, stat in result["modes"][mode]["on_time_utility"].items():
            kw: dict[str, Any] = dict(linestyle=style, marker="o" if mode == "sequenced" else "x")
            if name in colors:
                kw["color"] = colors[name]
            line = ax.plot(xs, stat["mean"], label=f"{name} ({mode})", **kw)[0]
            colors.setdefault(name, line.get_color())
    ax.set(xlabel="mean arrival rate (queries/s)", ylabel="OnTimeUtility",
           title=f"batches of {result['batch_size']} at one instant: sequenced vs concurrent decisions")
    ax.legend(fontsize=6, ncol=2)
    return [_save(fig, out / "herd.png")]
