"""Held-out evaluation of a trained predictor: MAE and R² of quality and output length, coverage
of the length quantiles (calibration), and whether the per-task quality ranking of the models is
recovered — per task × model and overall; plus a plot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bear.predictor.train import HEADS, Matrix

if TYPE_CHECKING:
    from bear.predictor.runtime import Predictor


def r2(y: np.ndarray, p: np.ndarray) -> float:
    ss = float(np.sum((y - y.mean()) ** 2))
    return float("nan") if ss == 0 else 1.0 - float(np.sum((y - p) ** 2)) / ss


def _metrics(y_q: np.ndarray, p_q: np.ndarray, y_l: np.ndarray, p: dict[str, np.ndarray]) -> dict[str, float]:
    return {
        "n": len(y_q),
        "acc_mae": float(np.mean(np.abs(y_q - p_q))),
        "acc_r2": r2(y_q, p_q),
        "acc_mean_true": float(y_q.mean()),
        "acc_mean_pred": float(p_q.mean()),
        "len_mae": float(np.mean(np.abs(y_l - p["len_mean"]))),
        "len_r2": r2(y_l, p["len_mean"]),
        "len_r2_log": r2(np.log1p(y_l), np.log1p(p["len_mean"])),
        "cover_p50": float(np.mean(y_l <= p["len_p50"])),
        "cover_p90": float(np.mean(y_l <= p["len_p90"])),
    }


def predict_matrix(predictor: Predictor, m: Matrix) -> dict[str, np.ndarray]:
    """Served values (head → array over the rows of ``m``), computed as the service computes them."""
    from bear.predictor.runtime import finalize

    served = finalize(predictor.raw_scores(m.X).tolist())
    return {name: np.asarray(v, dtype=np.float64) for name, v in zip(HEADS, served, strict=True)}


def evaluate(predictor: Predictor, m: Matrix) -> dict[str, Any]:
    """Report dict: ``overall``, ``by_task_model``, ``ranking`` (per task: true vs predicted order)."""
    p = predict_matrix(predictor, m)
    tasks = np.array(m.tasks)
    models = np.array(m.models)
    report: dict[str, Any] = {"overall": _metrics(m.quality, p["acc"], m.output_tokens, p), "by_task_model": {},
                              "ranking": {}}
    for t in sorted(set(m.tasks)):
        true_mean: dict[str, float] = {}
        pred_mean: dict[str, float] = {}
        for mod in sorted(set(m.models)):
            sel = (tasks == t) & (models == mod)
            if not sel.any():
                continue
            sub = {k: v[sel] for k, v in p.items()}
            report["by_task_model"][f"{t}/{mod}"] = _metrics(m.quality[sel], sub["acc"], m.output_tokens[sel], sub)
            true_mean[mod] = float(m.quality[sel].mean())
            pred_mean[mod] = float(sub["acc"].mean())
        true_order = sorted(true_mean, key=lambda k: -true_mean[k])
        pred_order = sorted(pred_mean, key=lambda k: -pred_mean[k])
        # Per query: does the predicted best model equal the true best model?
        report["ranking"][t] = {"true": true_order, "pred": pred_order, "match": true_order == pred_order}
    report["ranking_all_match"] = all(v["match"] for v in report["ranking"].values())
    return report


def plot(predictor: Predictor, m: Matrix, path: Path) -> None:
    """Three panels: predicted vs true length, predicted vs true quality, quantile coverage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = predict_matrix(predictor, m)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    tasks = np.array(m.tasks)
    for t in sorted(set(m.tasks)):
        sel = tasks == t
        ax[0].scatter(m.output_tokens[sel], p["len_mean"][sel], s=4, alpha=0.5, label=t)
        ax[1].scatter(m.quality[sel], p["acc"][sel], s=4, alpha=0.5, label=t)
    lim = [1, max(2.0, float(m.output_tokens.max()))]
    ax[0].plot(lim, lim, "k--", lw=0.8)
    ax[0].set(xscale="log", yscale="log", xlabel="true output tokens", ylabel="predicted mean",
              title="output length (held out)")
    ax[0].legend(markerscale=3)
    ax[1].plot([0, 1], [0, 1], "k--", lw=0.8)
    ax[1].set(xlabel="true quality", ylabel="predicted", title="quality (held out)")
    labels, c50, c90 = [], [], []
    for t in sorted(set(m.tasks)):
        sel = tasks == t
        labels.append(t)
        c50.append(float(np.mean(m.output_tokens[sel] <= p["len_p50"][sel])))
        c90.append(float(np.mean(m.output_tokens[sel] <= p["len_p90"][sel])))
    x = np.arange(len(labels))
    ax[2].bar(x - 0.2, c50, 0.4, label="≤ p50")
    ax[2].bar(x + 0.2, c90, 0.4, label="≤ p90")
    ax[2].axhline(0.5, color="C0", ls="--", lw=0.8)
    ax[2].axhline(0.9, color="C1", ls="--", lw=0.8)
    ax[2].set(xticks=x, ylim=(0, 1), ylabel="fraction of held-out answers", title="quantile calibration")
    ax[2].set_xticklabels(labels, rotation=15)
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
