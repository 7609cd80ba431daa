"""Fit the batch-time model of paper eq. 12 (or a roofline of two eq. 12 lines: ``fit_roofline``)
from ``bear.batch/1`` records.

β is fitted by non-negative least squares, and what is minimised is chosen for what β is used
for: a TTFT is a *sum* of batch times, so each batch's prediction should be its mean, and least
squares on the durations themselves (``absolute``, the default) estimates that mean. Minimising
relative residuals (``relative``: each row divided by its duration) optimises batch-time MAPE
instead: under multiplicative noise it predicts below the mean and the long prefill batches that
dominate a TTFT weigh least, so its TTFTs come out biased low — on the public real-vLLM traces
−7 % / −9 % median TTFT error and 13.1 % / 8.3 % TTFT MAPE, against −3 % and 11.9 % / 5.8 % for
``absolute`` (docs/estimator.md, "Calibration"; ``bear calibrate --cases`` measures it).
``sqrt`` (weights 1/√duration) lies between. The features come from libbea itself
(``libbea.batch_features``) so that calibration and replay share one definition of eq. 12.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np
from scipy.optimize import nnls

from bear import libbea
from bear.protocol import schemas
from bear.protocol.batch import BatchRecord, batch_record
from bear.protocol.jsonl import read_jsonl
from bear.protocol.messages import Calibration

T = TypeVar("T")


@dataclass(frozen=True)
class Fit:
    beta: tuple[float, float, float, float]
    mape: float  # mean absolute percentage error of the model on the fitted records
    n: int  # records used
    gamma: tuple[float, float, float, float] | None = None  # the roofline's second line (None: eq. 12)

    @property
    def coefficients(self) -> list[float]:
        return [*self.beta, *self.gamma] if self.gamma is not None else list(self.beta)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"beta": list(self.beta), "mape": self.mape, "n": self.n}
        if self.gamma is not None:
            out["gamma"] = list(self.gamma)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Fit:
        gamma = d.get("gamma")
        return cls(beta=_four(d["beta"], "beta"), mape=float(d.get("mape", float("nan"))), n=int(d.get("n", 0)),
                   gamma=None if gamma is None else _four(gamma, "gamma"))


def _four(v: Any, name: str) -> tuple[float, float, float, float]:
    """Four finite non-negative coefficients (a line of eq. 12), or ValueError naming ``name``."""
    if not isinstance(v, list | tuple) or len(v) != 4:
        raise ValueError(f"{name} must be a list of 4 numbers")
    b = [float(x) for x in v]
    if any(not np.isfinite(x) or x < 0 for x in b):
        raise ValueError(f"{name} must be finite and non-negative")
    return (b[0], b[1], b[2], b[3])


def read_records(paths: Iterable[str | Path]) -> Iterator[BatchRecord]:
    """bear.batch/1 records from JSONL files (``.gz`` accepted), one object per line;
    ValueError naming the file and line of one that is not a record."""
    for p in paths:
        for k, obj in enumerate(read_jsonl(p), 1):
            r = batch_record(obj)
            if r is None:
                raise ValueError(f"{p}: line {k} is not a {schemas.BATCH} record")
            yield r


def design_row(record: BatchRecord) -> tuple[float, float, float, float]:
    """The eq. 12 regressors [1, Σn, Σ decode context, Σ prefill attention] of one record."""
    tokens, decode_ctx, prefill_work = libbea.batch_features(record.items)
    return (1.0, tokens, decode_ctx, prefill_work)


def usable(record: BatchRecord) -> bool:
    """A record the fit learns from: a finite positive loop period and something computed."""
    d = record.duration_s
    return d is not None and d > 0 and np.isfinite(d) and bool(record.items)


def design_matrix(records: Iterable[BatchRecord]) -> tuple[np.ndarray, np.ndarray]:
    rows, ys = [], []
    for r in records:
        if usable(r):
            rows.append(design_row(r))
            ys.append(float(r.duration_s))  # type: ignore[arg-type]  # usable: not None
    return np.asarray(rows, dtype=float).reshape(-1, 4), np.asarray(ys, dtype=float)


def predict(coefficients: Iterable[float], x: np.ndarray) -> np.ndarray:
    """Batch times of eq. 12 rows: β (4 numbers), or the roofline β then γ (8): the larger line."""
    c = np.asarray(list(coefficients), dtype=float)
    if len(c) == 8:
        return np.maximum(x @ c[:4], x @ c[4:])
    return x @ c


def mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / y)) if len(y) else float("nan")


# Row weights of each objective, as a power of the observed duration: minimise Σ (w·(x·β − y))².
OBJECTIVES: dict[str, float] = {"absolute": 0.0, "sqrt": -0.5, "relative": -1.0}
DEFAULT_OBJECTIVE = "absolute"
MAX_FIT_MAPE = 1.0  # a fit that misses its records by more than this on average describes nothing


@dataclass(frozen=True)
class RefitPolicy:
    """How ``bear calibrator`` refits online (and ``bear eval``'s simulated pool with it): the
    last ``window`` batch records of an instance, every ``refit_s`` seconds once it has
    ``min_records`` and something new."""

    window: int = 2000
    min_records: int = 50
    refit_s: float = 5.0


class BatchWindow(Generic[T]):
    """The batches a refit reads: the newest ``window``, half of them kept for batches with a
    prefill chunk. At light load nearly every step is a decode; one sliding window then holds a
    few prefills, the fit loses the prefill terms of eq. 12, and the TTFTs it prices are those of
    prefills (the 8B alone at 30 % load: 29 % TTFT MAPE so, 11 % with the profiled β)."""

    def __init__(self, window: int) -> None:
        self.prefill: deque[T] = deque(maxlen=max(1, window // 2))
        self.decode: deque[T] = deque(maxlen=max(1, window - window // 2))
        self.new = 0  # batches added since the last refit

    def add(self, batch: T, has_prefill: bool) -> None:
        (self.prefill if has_prefill else self.decode).append(batch)
        self.new += 1

    def __len__(self) -> int:
        return len(self.prefill) + len(self.decode)

    def batches(self) -> list[T]:
        return [*self.decode, *self.prefill]


def fit_arrays(x: np.ndarray, y: np.ndarray, objective: str = DEFAULT_OBJECTIVE) -> Fit:
    """NNLS of ``objective`` (OBJECTIVES); each column is scaled to unit norm for conditioning."""
    if len(y) < 4:
        raise ValueError(f"need at least 4 usable batch records, got {len(y)}")
    try:
        w = y ** OBJECTIVES[objective]
    except KeyError:
        raise ValueError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}") from None
    a = x * w[:, None]
    b = y * w
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(a / scale, b)
    beta = coef / scale
    b = [float(v) for v in beta]
    return Fit(beta=(b[0], b[1], b[2], b[3]), mape=mape(predict(b, x), y), n=len(y))


ROOFLINE_GAIN = 0.10  # the roofline replaces eq. 12 when it cuts the fit's MAPE by at least this share
ROOFLINE_MIN = 20  # records on each side of its kink, at the least
ROOFLINE_ITERATIONS = 30


def fit_roofline(x: np.ndarray, y: np.ndarray, objective: str = DEFAULT_OBJECTIVE) -> Fit:
    """The batch-time model: eq. 12, or — where one line cannot follow the batches — a roofline
    of two eq. 12 lines, each step taking the larger (Williams, Waterman and Patterson, "Roofline",
    CACM 2009: a step is bound by memory traffic below its kink, by compute above). β is the
    memory-bound line, γ the compute-bound one. The kink is searched over the batches' token
    counts (each of 19 quantiles splits them; one line is fitted to each side), then refined by
    alternating least squares (each line refitted to the batches it predicts the larger time
    for) while that lowers the MAPE. Kept when it cuts eq. 12's MAPE by ROOFLINE_GAIN with
    ROOFLINE_MIN batches on each side (the 0.6B alone: eq. 12 misses its prefill steps by −17 % to
    +18 % by size, the roofline by under 3 %: docs/estimator.md, "Calibration")."""
    eq12 = fit_arrays(x, y, objective)
    if len(y) < 2 * ROOFLINE_MIN:
        return eq12

    def split(upper: np.ndarray) -> Fit | None:
        if upper.sum() < ROOFLINE_MIN or (~upper).sum() < ROOFLINE_MIN:
            return None
        low, high = fit_arrays(x[~upper], y[~upper], objective), fit_arrays(x[upper], y[upper], objective)
        return Fit(beta=low.beta, gamma=high.beta, mape=mape(predict([*low.beta, *high.beta], x), y), n=len(y))

    best: Fit | None = None
    for q in np.unique(np.quantile(x[:, 1], np.linspace(0.05, 0.95, 19))):
        f = split(x[:, 1] > q)
        if f is not None and (best is None or f.mape < best.mape):
            best = f
    for _ in range(ROOFLINE_ITERATIONS if best is not None else 0):
        assert best is not None and best.gamma is not None  # split() always sets both lines
        f = split((x @ np.asarray(best.gamma)) > (x @ np.asarray(best.beta)))
        if f is None or not f.mape < best.mape:
            break
        best = f
    if best is not None and best.mape <= (1.0 - ROOFLINE_GAIN) * eq12.mape:
        return best
    return eq12


def fit_beta(records: Iterable[BatchRecord], objective: str = DEFAULT_OBJECTIVE) -> Fit:
    """Fit β from bear.batch/1 records (records with a null duration are skipped)."""
    x, y = design_matrix(records)
    return fit_arrays(x, y, objective)


def prefill_throughput(records: Iterable[BatchRecord]) -> float:
    """θ_pre of paper eq. 8: prefill tokens of batches with a prefill chunk / their total time."""
    tokens = 0.0
    seconds = 0.0
    for r in records:
        if not usable(r):
            continue
        pre = sum(it["n"] for it in r.items if not it["decode"])
        if pre > 0:
            tokens += pre
            seconds += float(r.duration_s)  # type: ignore[arg-type]  # usable: not None
    if seconds <= 0:
        raise ValueError("no batch with a prefill chunk and a duration")
    return tokens / seconds


def robust_fit(records: list[BatchRecord], instance: str = "", objective: str = DEFAULT_OBJECTIVE,
               prior: Calibration | None = None) -> Calibration:
    """The calibration that ``bear calibrator`` publishes (and ``bear eval`` uses) from
    ``bear.batch/1`` records: ``refit_arrays`` of their eq. 12 rows (``prior``: the instance's
    calibration before serving, if any)."""
    kept = [r for r in records if usable(r)]
    x, y = design_matrix(kept)
    prefill = np.array([sum(it["n"] for it in r.items if not it["decode"]) for r in kept], dtype=float)
    return refit_arrays(x, y, prefill, instance, objective, prior)


def refit_arrays(x: np.ndarray, y: np.ndarray, prefill_tokens: np.ndarray, instance: str = "",
                 objective: str = DEFAULT_OBJECTIVE, prior: Calibration | None = None) -> Calibration:
    """The online refit over eq. 12 rows: a free ``robust_fit_arrays`` — unless the instance was
    profiled before serving (``prior.source == "profiled"``) and the free fit prices a batch every
    engine runs (``REFERENCE_BATCHES``) more than ``MAX_PROFILE_DISAGREEMENT`` times off the
    profile rescaled to the rows: then the rescaled profile (``rescale_fit_arrays``). A window
    that spans what the engine runs fits best freely (on ``bear eval``'s seed 7301, alone at 60 %
    of saturation, the rescaled profile alone gave 10 % TTFT MAPE against 4–5 %); a first window
    of decodes and short prefills does not. ``bear calibrator`` and ``bear eval``'s simulated one
    both call it."""
    if prior is None or prior.source != "profiled":
        return robust_fit_arrays(x, y, prefill_tokens, instance, objective)
    scaled = rescale_fit_arrays(x, y, prefill_tokens, prior, instance)
    try:
        free = robust_fit_arrays(x, y, prefill_tokens, instance, objective)
    except ValueError:
        return scaled
    if _agrees(free, scaled):
        return free
    # The window does not span what the engine may run: the profile, rescaled, speaks for the
    # prefill chunks beyond the window's largest, the window for itself (``anchored_fit_arrays``).
    try:
        anchored = anchored_fit_arrays(x, y, prefill_tokens, scaled, instance, objective)
    except ValueError:
        return scaled
    if anchored is None or not _agrees(anchored, scaled):
        return scaled
    # the engine's pace against its profile, and the profile itself (a restarted calibrator reads it back)
    return msgspec.structs.replace(anchored, scale=scaled.scale, profile=tuple(prior.coefficients))


def _agrees(fit: Calibration, scaled: Calibration) -> bool:
    """``fit`` prices every REFERENCE_BATCHES row within MAX_PROFILE_DISAGREEMENT× of ``scaled``."""
    ratio = predict(fit.coefficients, REFERENCE_BATCHES) / np.maximum(predict(scaled.coefficients, REFERENCE_BATCHES),
                                                                      1e-12)
    return bool(np.all((ratio <= MAX_PROFILE_DISAGREEMENT) & (ratio >= 1 / MAX_PROFILE_DISAGREEMENT)))


# The prefill chunks the rescaled profile prices for a window that has none as large (anchors):
# ANCHOR_SIZES sizes from twice the window's largest chunk (at least ANCHOR_MIN_TOKENS) up to
# ANCHOR_MAX_TOKENS (vLLM's default budget for chunked prefill), at each of ANCHOR_CONTEXTS
# tokens computed before them — enough rows for fit_roofline's compute-bound side (ROOFLINE_MIN).
ANCHOR_SIZES = 8
ANCHOR_CONTEXTS = (0.0, 4096.0, 16384.0)
ANCHOR_MIN_TOKENS = 256.0
ANCHOR_MAX_TOKENS = 8192.0


def anchored_fit_arrays(x: np.ndarray, y: np.ndarray, prefill_tokens: np.ndarray, scaled: Calibration,
                        instance: str = "", objective: str = DEFAULT_OBJECTIVE) -> Calibration | None:
    """The free fit of a window that holds only decodes and short prefills (a pool that sends an
    instance short prompts: the 32B in ``bear eval``'s pool), with the rescaled profile's prices of
    the prefill chunks beyond the window added as rows. Without them the free fit extrapolates
    (an 8k chunk priced 20× below the profile) and the rescaled profile is published instead —
    whose one-line shape, a compromise over every kind of batch, then misses the window's own
    steps (seed 7301, 32B at 5 q/s: +6.9 % median on its steps with a prefill, −3.9 % on its decodes,
    the free fit 0.1 %). With them, fit_roofline takes the window's steps on one line and the
    anchors on the other: each side priced by what knows it. None when the window already holds
    chunks as large as the largest anchor (nothing to anchor)."""
    largest = float(prefill_tokens.max()) if len(prefill_tokens) else 0.0
    low = max(ANCHOR_MIN_TOKENS, 2.0 * largest)
    if low >= ANCHOR_MAX_TOKENS:
        return None
    sizes = np.geomspace(low, ANCHOR_MAX_TOKENS, ANCHOR_SIZES)
    ax = np.array([[1.0, n, 0.0, n * c + n * (n + 1.0) / 2.0] for n in sizes for c in ANCHOR_CONTEXTS])
    ay = predict(scaled.coefficients, ax)
    fit = robust_fit_arrays(np.vstack([x, ax]), np.concatenate([y, ay]), np.concatenate([prefill_tokens, ax[:, 1]]),
                            instance, objective)
    # θ and the fit's own error are the window's, not the anchors'
    theta = _theta(x, y, prefill_tokens)
    return msgspec.structs.replace(fit, theta=scaled.theta if theta is None else theta,
                                   mape=mape(predict(fit.coefficients, x), y), n=len(y))


def _theta(x: np.ndarray, y: np.ndarray, prefill_tokens: np.ndarray) -> float | None:
    """θ of eq. 8 over the window's batches with a prefill chunk."""
    seconds = float(y[prefill_tokens > 0].sum())
    return float(prefill_tokens[prefill_tokens > 0].sum()) / seconds if seconds > 0 else None


# Batches every serving engine runs, as eq. 12 rows [1, Σn, Σ decode context, Σ prefill work]:
# prefill chunks of 256 / 2,048 / 8,192 tokens from an empty context and 16k tokens in, decode
# batches of 1 / 32 / 256 requests at 1,024 tokens of context each.
REFERENCE_BATCHES = np.array(
    [[1.0, n, 0.0, n * c + n * (n + 1) / 2.0] for n in (256, 2048, 8192) for c in (0, 16384)]
    + [[1.0, r, r * 1024.0, 0.0] for r in (1, 32, 256)])
# A free refit that prices one of them more than this many times off the rescaled profile is
# extrapolating beyond its window (the 32B's first fits: 20× below on an 8k chunk), not tracking
# a drift of the engine: the rescaled profile is published instead.
MAX_PROFILE_DISAGREEMENT = 2.0


def rescale_fit_arrays(x: np.ndarray, y: np.ndarray, prefill_tokens: np.ndarray, prior: Calibration,
                       instance: str = "") -> Calibration:
    """The profiled calibration times one factor s fitted to the records — how much slower (s > 1)
    or faster the engine runs now than when it was profiled.

    Why not a free refit: a serving window rarely spans what a profile sweeps. Its first records
    are decodes and short prefills, where eq. 12's per-token and prefill-attention terms cannot be
    told apart, and NNLS then sets them to 0 — on the 32B that fit priced a waiting 8k-token
    prompt at 0.1 s for queries that waited 2–5 s (docs/estimator.md, "Calibration before
    serving"). One factor is identified by any batch and keeps the profile's shape where the window
    has no data; what the engine does differently from its profile in shape shows as the fit's
    MAPE, which the calibrator logs. s is least squares on the durations (the ``absolute``
    objective: a TTFT sums batch times, so each should be its mean), after the same outlier trim
    as ``robust_fit_arrays``."""
    base = predict(prior.coefficients, x)
    ok = (base > 0) & (y > 0)
    if ok.sum() < 4:
        raise ValueError("fewer than 4 usable records to rescale the profiled calibration with")
    base_ok, y_ok = base[ok], y[ok]
    ratio = y_ok / base_ok
    rel = np.abs(ratio / float(np.median(ratio)) - 1.0)
    med = float(np.median(rel))
    mad = float(np.median(np.abs(rel - med)))
    keep = rel <= max(med + 3.0 * 1.4826 * mad, float(np.quantile(rel, 0.5)))
    s = float(np.dot(y_ok[keep], base_ok[keep]) / np.dot(base_ok[keep], base_ok[keep]))
    fit_mape = mape(s * base_ok[keep], y_ok[keep])
    if not fit_mape <= MAX_FIT_MAPE:
        raise ValueError(f"the rescaled profile misses its records by {fit_mape:.0%} on average: not published")
    pf = prefill_tokens[ok][keep]
    seconds = float(y_ok[keep][pf > 0].sum())
    theta = float(pf[pf > 0].sum()) / seconds if seconds > 0 else (
        prior.theta / s if prior.theta is not None else None)
    scaled = tuple(float(b) * s for b in prior.beta)
    gamma = None if prior.gamma is None else tuple(float(g) * s for g in prior.gamma)
    return Calibration(instance=instance, beta=scaled, gamma=gamma, mape=fit_mape,  # type: ignore[arg-type]
                       n=int(keep.sum()), theta=theta, objective="absolute", updated=time.time(), source="online",
                       scale=s)


def robust_fit_arrays(x: np.ndarray, y: np.ndarray, prefill_tokens: np.ndarray, instance: str = "",
                      objective: str = DEFAULT_OBJECTIVE) -> Calibration:
    """β by NNLS after trimming outliers (records whose relative residual is beyond median +
    3·1.4826·MAD: GC pauses, preemption storms, co-located noise; at least half is always kept),
    and θ of eq. 8 over the kept records (``prefill_tokens``: each batch's prefill tokens).
    Outliers are found with a relative fit whatever the objective: a least-squares first pass is
    pulled towards the long batches an outlier inflates, and then misses exactly those (a 5 %
    share of 8× durations moved the final β by 30 %)."""
    first = fit_roofline(x, y, "relative")
    rel = np.abs(predict(first.coefficients, x) - y) / y
    med = float(np.median(rel))
    mad = float(np.median(np.abs(rel - med)))
    cut = max(med + 3.0 * 1.4826 * mad, float(np.quantile(rel, 0.5)))
    keep = rel <= cut
    if keep.sum() < 4:
        keep[:] = True
    cal = fit_roofline(x[keep], y[keep], objective)
    if not cal.mape <= MAX_FIT_MAPE:
        raise ValueError(f"the fit misses its own records by {cal.mape:.0%} on average: not published")
    with_prefill = keep & (prefill_tokens > 0)
    seconds = float(y[with_prefill].sum())
    theta: float | None = float(prefill_tokens[with_prefill].sum()) / seconds if seconds > 0 else None
    return Calibration(instance=instance, beta=cal.beta, gamma=cal.gamma, mape=cal.mape, n=cal.n, theta=theta,
                       objective=objective, updated=time.time())
