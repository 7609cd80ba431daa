"""PNG figures for ``bear eval`` (matplotlib, headless)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLE = {"bear": dict(color="black", linewidth=2.5, marker="o")}


def _lines(ax: Any, xs: list[float], table: dict[str, list[float]]) -> None:
    for name, ys in table.items():
        ax.plot(xs, ys, label=name, **STYLE.get(name, dict(marker=".", linewidth=1.2)))


def rates(result: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    _lines(axes[0], result["rates"], result["policies"])
    axes[0].set(xlabel="arrival rate (queries/s)", ylabel="OnTimeUtility (eq. 6)", title="OnTimeUtility vs load")
    axes[0].legend(fontsize=7)
    _lines(axes[1], result["rates"], result["slo_attainment"])
    axes[1].set(xlabel="arrival rate (queries/s)", ylabel="TTFT target met", title="SLO attainment")
    # routing composition of BEAR per rate (stacked, hatched = missed target)
    comp = result["composition"]["bear"]
    insts = sorted({i for c in comp for i in c})
    bottom = [0.0] * len(result["rates"])
    x = list(range(len(result["rates"])))
    for inst in insts:
        share = [c.get(inst, {}).get("share", 0.0) for c in comp]
        met = [s * c.get(inst, {}).get("on_time_share", 0.0) for s, c in zip(share, comp, strict=True)]
        bars = axes[2].bar(x, met, bottom=bottom, label=inst)
        color = bars.patches[0].get_facecolor() if bars.patches else None
        axes[2].bar(x, [s - m for s, m in zip(share, met, strict=True)],
                    bottom=[b + m for b, m in zip(bottom, met, strict=True)], color=color, hatch="//", alpha=0.5)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    axes[2].set_xticks(x, [f"{r:g}" for r in result["rates"]])
    axes[2].set(xlabel="arrival rate (queries/s)", ylabel="share of queries", title="BEAR routing (hatched: missed)")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def xy(result: dict[str, Any], path: Path, x: str, title: str, xlabel: str, log: bool = False) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _lines(ax, result[x], result["policies"])
    if log:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel="OnTimeUtility", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def delta(result: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curve = result["lagrange"]
    ax.plot([c["mean_ttft_s"] * 1e3 for c in curve], [c["mean_utility"] for c in curve], "k-o", label="BEAR (eq. 7, δ sweep)")
    for c in curve:
        ax.annotate(f"δ={c['delta']:g}", (c["mean_ttft_s"] * 1e3, c["mean_utility"]), fontsize=6)
    for name, p in result["policies"].items():
        if math.isfinite(p["mean_ttft_s"]):
            ax.plot(p["mean_ttft_s"] * 1e3, p["mean_utility"], "s", label=name)
    ax.set(xlabel="mean TTFT (ms)", ylabel="mean utility", title=f"utility–latency trade-off at {result['rate']:g} q/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bursty(result: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, len(result), figsize=(6 * len(result), 4.5))
    for ax, (name, r) in zip(axes, result.items(), strict=True):
        _lines(ax, r["rates"], r["policies"])
        ax.set(xlabel="mean arrival rate (queries/s)", ylabel="OnTimeUtility", title=f"MMPP-2 {name}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def staleness(result: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ms = [d * 1e3 for d in result["delays_s"]]
    ax.plot(ms, result["compensated"], "k-o", label="BEAR, snapshot advanced by its age")
    ax.plot(ms, result["uncompensated"], "--o", label="BEAR, snapshot used as is")
    ax.set(xlabel="snapshot delay (ms)", ylabel="OnTimeUtility", title=f"stale snapshots at {result['rate']:g} q/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def accuracy(result: dict[str, Any], path: Path) -> None:
    names = [n for n, v in result["policies"].items() if v["n"]]
    mape = [result["policies"][n]["mape"] * 100 for n in names]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(names, mape)
    ax.set_yscale("log")
    ax.set(ylabel="MAPE vs observed TTFT (%)", title=f"latency estimates at {result['rate']:g} q/s")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
