"""Training of the four LightGBM heads (quality, output length mean / p50 / p90) and the model
directory they are saved in (``meta.json`` + one LightGBM text model per head)."""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bear.predictor.dataset import Record, iter_groups
from bear.predictor.features import FEATURE_NAMES, MODEL_ID_COLUMN, Pca, analyse, feature_rows, model_part
from bear.predictor.models import DEFAULT_MODELS, ModelSpec
from bear.protocol import schemas
from bear.protocol.errors import BearError, ErrorCode

FORMAT = schemas.PREDICTOR
# head name → LightGBM objective settings. Quality: Huber (paper A.4); length: L2 on raw counts for
# the mean (what the cost and the replay use), pinball loss for the quantiles.
HEADS: dict[str, dict[str, Any]] = {
    "acc": {"objective": "huber", "alpha": 0.15},
    "len_mean": {"objective": "regression"},
    "len_p50": {"objective": "quantile", "alpha": 0.5},
    "len_p90": {"objective": "quantile", "alpha": 0.9},
}
Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass
class TrainConfig:
    rounds: int = 150
    learning_rate: float = 0.1
    num_leaves: int = 15
    min_data_in_leaf: int = 20
    test_fraction: float = 0.2
    seed: int = 0
    threads: int = 1


@dataclass
class Matrix:
    """Feature rows and targets of a set of records (row i ↔ record i)."""

    X: np.ndarray
    quality: np.ndarray
    output_tokens: np.ndarray
    tasks: list[str]
    models: list[str]
    groups: list[str] = field(default_factory=list)


def is_test_group(group: str, fraction: float, seed: int) -> bool:
    """Stable split by query: a prompt is in train or in test for all its models."""
    return (zlib.crc32(f"{seed}:{group}".encode()) % 10_000) < fraction * 10_000


def build_matrix(records: list[Record], specs: dict[str, ModelSpec], pca: Pca | None,
                 progress: Progress | None = None) -> tuple[Matrix, Pca]:
    """Featurise every record (each prompt once); fits the PCA on these prompts when ``pca`` is None."""
    unknown = sorted({r.model for r in records} - set(specs))
    if unknown:
        raise BearError(ErrorCode.NOT_FOUND, f"models without a spec: {unknown} (pass --models FILE)")
    index = {name: i for i, name in enumerate(specs)}
    groups = list(iter_groups(records))
    analyses = []
    for k, (_, idx) in enumerate(groups):
        analyses.append(analyse(records[idx[0]].prompt))
        if progress is not None and (k % 50 == 0 or k == len(groups) - 1):
            progress("features", k + 1, len(groups))
    if pca is None:
        pca = Pca.fit(np.stack([a.hashed for a in analyses]))
    X = np.empty((len(records), len(FEATURE_NAMES)))
    gnames = [""] * len(records)
    for (g, idx), a in zip(groups, analyses, strict=True):
        parts = np.stack([model_part(index[records[i].model], specs[records[i].model]) for i in idx])
        X[idx] = feature_rows(a, pca, parts)
        for i in idx:
            gnames[i] = g
    m = Matrix(
        X=X,
        quality=np.array([r.quality for r in records]),
        output_tokens=np.array([r.output_tokens for r in records], dtype=np.float64),
        tasks=[r.task for r in records],
        models=[r.model for r in records],
        groups=gnames,
    )
    return m, pca


def subset(m: Matrix, mask: np.ndarray) -> Matrix:
    sel = np.flatnonzero(mask)
    return Matrix(m.X[sel], m.quality[sel], m.output_tokens[sel], [m.tasks[i] for i in sel],
                  [m.models[i] for i in sel], [m.groups[i] for i in sel])


def train_heads(m: Matrix, cfg: TrainConfig, progress: Progress | None = None) -> dict[str, Any]:
    """One LightGBM booster per head."""
    import lightgbm as lgb

    boosters: dict[str, Any] = {}
    total = cfg.rounds * len(HEADS)
    done = 0
    for name, objective in HEADS.items():
        y = m.quality if name == "acc" else m.output_tokens
        params = {
            **objective,
            "learning_rate": cfg.learning_rate,
            "num_leaves": cfg.num_leaves,
            "min_data_in_leaf": cfg.min_data_in_leaf,
            "feature_fraction": 0.9,
            "bagging_fraction": 0.9,
            "bagging_freq": 1,
            "seed": cfg.seed,
            "num_threads": cfg.threads,
            "verbose": -1,
        }
        ds = lgb.Dataset(m.X, y, feature_name=FEATURE_NAMES, categorical_feature=[MODEL_ID_COLUMN],
                         free_raw_data=False)

        def _cb(env: Any, base: int = done) -> None:
            if progress is not None and (env.iteration % 10 == 0 or env.iteration + 1 == env.end_iteration):
                progress("boosting", base + env.iteration + 1, total)

        boosters[name] = lgb.train(params, ds, num_boost_round=cfg.rounds, callbacks=[_cb])
        done += cfg.rounds
    return boosters


def save_model_dir(out: Path, boosters: dict[str, Any], pca: Pca, specs: list[ModelSpec],
                   info: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, b in boosters.items():
        b.save_model(str(out / f"{name}.txt"))
    meta = {
        "format": FORMAT,
        "created": time.time(),
        "feature_names": FEATURE_NAMES,
        "models": [s.to_dict() for s in specs],
        "heads": list(boosters),
        "pca": pca.to_dict(),
        "info": info,
    }
    (out / "meta.json").write_text(json.dumps(meta))


def train(records: list[Record], out: Path, specs: list[ModelSpec] | None = None,
          cfg: TrainConfig | None = None, progress: Progress | None = None) -> tuple[Matrix, Matrix]:
    """Split by query, fit PCA + heads on train, save to ``out``; returns (train, test) matrices."""
    cfg = cfg or TrainConfig()
    specs = list(specs or DEFAULT_MODELS)
    used = {r.model for r in records}
    specs = [s for s in specs if s.name in used]
    by_name = {s.name: s for s in specs}
    is_test = np.array([is_test_group(r.group, cfg.test_fraction, cfg.seed) for r in records])
    train_recs = [r for r, t in zip(records, is_test, strict=True) if not t]
    test_recs = [r for r, t in zip(records, is_test, strict=True) if t]
    if not train_recs:
        raise BearError(ErrorCode.BAD_REQUEST, "no training records after the split")
    m_train, pca = build_matrix(train_recs, by_name, None, progress)
    m_test, _ = build_matrix(test_recs, by_name, pca, None) if test_recs else (subset(m_train, np.zeros(0, bool)), pca)
    boosters = train_heads(m_train, cfg, progress)
    info = {"n_train": len(train_recs), "n_test": len(test_recs), "config": cfg.__dict__,
            "synthetic": any(r.synthetic for r in records)}
    save_model_dir(out, boosters, pca, specs, info)
    return m_train, m_test
