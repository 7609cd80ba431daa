"""The trained predictor in memory: prompt + candidate models → accuracy, output length (mean,
p50, p90) and cost per model. Synchronous and thread-safe (no shared mutable state per call).

Per request: the prompt analysis in C++ (``features.analyse``), the PCA projection in numpy
(exactly the training computation), and all heads x candidate rows evaluated in one C++ call
(``forest.NativeForest``, bit-identical to LightGBM). A model directory whose trees the native
forest cannot serve (see ``forest``) is served by LightGBM's ``Booster.predict``, with a warning
at load time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from bear.predictor.features import FEATURE_NAMES, Pca, PromptAnalysis, analyse, feature_rows, model_part
from bear.predictor.forest import ForestUnsupported, NativeForest
from bear.predictor.models import ModelSpec
from bear.predictor.tokens import TokenCounter
from bear.predictor.train import FORMAT, HEADS
from bear.protocol.errors import BearError, ErrorCode

log = structlog.get_logger(__name__)


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


def _np_max(a: float, b: float) -> float:
    """``np.maximum`` of two floats (NaN propagates; on ties the first)."""
    return a if (a >= b or a != a) else b


def _np_clip01(x: float) -> float:
    """``np.clip(x, 0.0, 1.0)`` of one float (NaN propagates, -0.0 stays -0.0)."""
    v = 0.0 if x < 0.0 else x
    return 1.0 if v > 1.0 else v


def finalize(raw: list[list[float]]) -> list[list[float]]:
    """Raw [acc, len_mean, len_p50, len_p90] head outputs (each a list over rows) → served values:
    quality in [0, 1], lengths ≥ 1 token, p90 ≥ p50 (quantiles must not cross). Plain Python:
    numpy's per-call overhead would be most of the cost at 3 rows. NaN propagates."""
    acc, mean, p50, p90 = raw
    p50 = [_np_max(x, 1.0) for x in p50]
    return [[_np_clip01(x) for x in acc], [_np_max(x, 1.0) for x in mean], p50,
            [_np_max(x, y) for x, y in zip(p90, p50, strict=True)]]


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
        # In the order finalize expects: acc, len_mean, len_p50, len_p90.
        self.boosters = {name: lgb.Booster(model_file=str(model_dir / f"{name}.txt")) for name in HEADS}
        self.tokens = TokenCounter(self.specs, tokenizer_dir)
        self._index = {s.name: i for i, s in enumerate(self.specs)}
        self._part_rows = np.stack([self._parts[s.name] for s in self.specs])
        every_model = list(range(len(self.specs)))
        probe = np.vstack([self._rows(analyse(p), every_model) for p in _PROBE_PROMPTS])
        self.forest: NativeForest | None = None
        try:
            self.forest = NativeForest.build(self.boosters, probe)
        except ForestUnsupported as exc:
            log.warning("native_forest_unsupported", model_dir=str(model_dir), reason=str(exc),
                        fallback="LightGBM Booster.predict per head (slower per request)")

    @property
    def models(self) -> list[str]:
        return [s.name for s in self.specs]

    def _rows(self, a: PromptAnalysis, ids: list[int]) -> np.ndarray:
        return feature_rows(a, self.pca, self._part_rows[ids])

    def raw_scores(self, X: np.ndarray) -> np.ndarray:
        """Raw head outputs for feature rows ``X``, shape (heads, rows) in ``HEADS`` order."""
        if self.forest is not None:
            return self.forest.predict(X)
        return np.stack([b.predict(X, num_threads=1) for b in self.boosters.values()])

    def _ids(self, models: list[str]) -> list[int]:
        try:
            return [self._index[m] for m in models]
        except KeyError:
            unknown = [m for m in models if m not in self._index]
            raise BearError(ErrorCode.NOT_FOUND, f"unknown models {unknown}; known: {self.models}") from None

    def predict_raw(self, prompt: str, models: list[str],
                    prompt_tokens: dict[str, int] | None = None) -> tuple[list[list[float]], dict[str, int]]:
        """([acc, len_mean, len_p50, len_p90] served values, each a list over ``models``; prompt token
        counts per model). Unknown models raise NOT_FOUND."""
        ids = self._ids(models)
        a = analyse(prompt)
        if self.forest is not None:
            raw = self.forest.predict_parts(self.pca.project(a.hashed), a.scalars, self._part_rows, ids)
        else:
            raw = self.raw_scores(self._rows(a, ids))
        y = finalize(raw.tolist())
        if prompt_tokens:
            need = [m for m in models if m not in prompt_tokens]
            counts = {**self.tokens.counts(prompt, need, a.n_pieces), **prompt_tokens}
        else:
            counts = self.tokens.counts(prompt, models, a.n_pieces)
        return y, counts

    def predict(self, prompt: str, models: list[str],
                prompt_tokens: dict[str, int] | None = None) -> list[Prediction]:
        """One prediction per model, in the order given. Unknown models raise NOT_FOUND."""
        (acc, mean, p50, p90), counts = self.predict_raw(prompt, models, prompt_tokens)
        out = []
        for i, m in enumerate(models):
            spec = self.by_name[m]
            out.append(Prediction(m, acc[i], mean[i], p50[i], p90[i],
                                  int(counts[m]), spec.cost_usd(counts[m], mean[i])))
        return out

    def predict_wire(self, prompt: str, models: list[str],
                     prompt_tokens: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
        """``{model: Prediction.to_wire()}`` without the intermediate objects (the service's path)."""
        (acc, mean, p50, p90), counts = self.predict_raw(prompt, models, prompt_tokens)
        by_name = self.by_name
        out: dict[str, dict[str, Any]] = {}
        for i, m in enumerate(models):
            n = int(counts[m])
            out[m] = {"acc": acc[i], "len": {"mean": mean[i], "p50": p50[i], "p90": p90[i]},
                      "prompt_tokens": n, "cost": by_name[m].cost_usd(n, mean[i])}
        return out


# Rows for the load-time check of the native forest against LightGBM (with every model id).
_PROBE_PROMPTS = (
    "List five facts about enzymes.",
    "Summarize the report above briefly, in 50 words.",
    "Write a story in 800 words.\n\n[WP] The moon files a complaint.",
    "Explain in detail how a compiler works? " * 40,
    "",
)
