"""The trained predictor in memory: prompt + candidate models → accuracy, output length (mean,
p50, p90) and cost per model. Synchronous and thread-safe; the service calls it off the loop."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bear.predictor.fastlgb import FastBooster
from bear.predictor.features import FEATURE_NAMES, Pca, analyse, model_part, prompt_row, rows_for_models
from bear.predictor.models import ModelSpec
from bear.predictor.tokens import TokenCounter
from bear.predictor.train import FORMAT, HEADS
from bear.protocol.errors import BearError, ErrorCode


@dataclass(frozen=True)
class Prediction:
    model: str
    acc: float
    len_mean: float
    len_p50: float
    len_p90: float
    prompt_tokens: int
    cost: float  # USD, from prompt tokens and the mean output length

    def to_wire(self) -> dict[str, Any]:
        return {
            "acc": self.acc,
            "len": {"mean": self.len_mean, "p50": self.len_p50, "p90": self.len_p90},
            "prompt_tokens": self.prompt_tokens,
            "cost": self.cost,
        }


def finalize(raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Raw head outputs → served values: quality in [0, 1], lengths ≥ 1 token, p90 ≥ p50."""
    out = dict(raw)
    out["acc"] = np.clip(raw["acc"], 0.0, 1.0)
    out["len_mean"] = np.maximum(raw["len_mean"], 1.0)
    out["len_p50"] = np.maximum(raw["len_p50"], 1.0)
    out["len_p90"] = np.maximum(raw["len_p90"], out["len_p50"])  # quantiles must not cross
    return out


class Predictor:
    """Loaded model directory (see ``train.save_model_dir``)."""

    def __init__(self, model_dir: Path, tokenizer_dir: Path | None = None) -> None:
        import lightgbm as lgb

        model_dir = Path(model_dir)
        try:
            meta = json.loads((model_dir / "meta.json").read_text())
        except FileNotFoundError as exc:
            raise BearError(ErrorCode.UNAVAILABLE, f"no trained predictor in {model_dir}") from exc
        if meta.get("format") != FORMAT or meta.get("feature_names") != FEATURE_NAMES:
            raise BearError(ErrorCode.UNAVAILABLE, f"{model_dir} was trained by an incompatible version")
        self.meta = meta
        self.model_dir = model_dir
        self.specs = [ModelSpec.from_dict(d) for d in meta["models"]]
        self.by_name = {s.name: s for s in self.specs}
        self._parts = {s.name: model_part(i, s) for i, s in enumerate(self.specs)}
        self.pca = Pca.from_dict(meta["pca"])
        self.heads = {name: FastBooster(lgb.Booster(model_file=str(model_dir / f"{name}.txt"))) for name in HEADS}
        self.tokens = TokenCounter(self.specs, tokenizer_dir)

    @property
    def models(self) -> list[str]:
        return [s.name for s in self.specs]

    def predict(self, prompt: str, models: list[str],
                prompt_tokens: dict[str, int] | None = None) -> list[Prediction]:
        """One prediction per model, in the order given. Unknown models raise NOT_FOUND."""
        unknown = [m for m in models if m not in self.by_name]
        if unknown:
            raise BearError(ErrorCode.NOT_FOUND, f"unknown models {unknown}; known: {self.models}")
        a = analyse(prompt)
        X = rows_for_models(prompt_row(a, self.pca), [self._parts[m] for m in models])
        y = finalize({name: head.predict(X) for name, head in self.heads.items()})
        acc, mean, p50, p90 = y["acc"], y["len_mean"], y["len_p50"], y["len_p90"]
        given = prompt_tokens or {}
        need = [m for m in models if m not in given]
        counts = {**self.tokens.counts(prompt, need, a.n_pieces), **given}
        out = []
        for i, m in enumerate(models):
            spec = self.by_name[m]
            out.append(Prediction(m, float(acc[i]), float(mean[i]), float(p50[i]), float(p90[i]),
                                  int(counts[m]), spec.cost_usd(counts[m], float(mean[i]))))
        return out
