"""The paper's experiments over the virtual-time pool, each a list of simulation cells and a
function that turns their results into a JSON-able result.

Every seed has one setup (trained predictor, evaluation queries with their predictions, per-
instance profiling: calibration and the latencies it observed), cached on disk. The routers
compared are the entries of ``comparison.json`` — a policy, its parameters (the tuned baselines'
frozen there) and the estimator configuration it runs under — so no experiment special-cases a
policy. Cells of any number of seeds and experiments run in one process pool.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pickle
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bear.estimator.estimate import EstimatorConfig
from bear.evaluation import reliability
from bear.evaluation.cluster import PAPER_POOL, Cluster, InstanceSpec, Verdict, calibrate_pool
from bear.evaluation.learned import Sample, online_predictions
from bear.evaluation.workload import QuerySet, build_queries
from bear.load.arrivals import Mmpp2, poisson_arrivals
from bear.load.metrics import Outcome, composition, summary, ttft_prediction_error
from bear.load.targets import ttft_target_s
from bear.predictor.synth import default_cache_dir, trained_predictor_dir
from bear.protocol.messages import Calibration
from bear.router.policies import make_policy
from bear.sim.profile import Profile

CONFIG = Path(__file__).with_name("comparison.json")
PAPER_RATES = [5.0, 6.0, 7.0, 8.0, 8.9]  # Fig. 8's arrival rates (q/s)
PAPER_RATE = 8.0  # Figs. 9 and 14
DEFAULT_LAMBDA = 5e-4  # §5.1
HEADLINE_SEEDS = (2026, 2027, 2028)  # seeds no earlier result of this project used
SETUP_VERSION = "v9"  # v9: the profiling calibration says so (Calibration.source); v8: it may be a roofline


# ------------------------------------------------------------------------------------- entries
@dataclass(frozen=True)
class Entry:
    """One router of the comparison: a registry policy, its parameters, its estimator settings."""

    name: str
    policy: str
    role: str  # ours | baseline | ablation
    label: str = ""
    params: tuple[tuple[str, float], ...] = ()
    estimator: tuple[tuple[str, bool | int], ...] = ()


@functools.lru_cache(maxsize=4)
def load_config(path: Path = CONFIG) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def entries(path: Path = CONFIG) -> dict[str, Entry]:
    out = {}
    for name, d in load_config(path)["entries"].items():
        out[name] = Entry(name=name, policy=d["policy"], role=d["role"], label=d.get("label", name),
                          params=tuple(sorted(d.get("params", {}).items())),
                          estimator=tuple(sorted(d.get("estimator", {}).items())))
    return out


def names(role: str) -> list[str]:
    return [n for n, e in entries().items() if e.role == role]


def baselines() -> list[str]:
    return names("baseline")


def rate_entries() -> list[str]:
    """What the rates experiment compares: BEAR (as the paper describes it, with the extensions, with
    the overflow rule too), the baselines, the eq. 8 ablation under eq. 5's rule and under the
    overflow rule."""
    return ["bear", "bear+ext", "bear+overflow", *baselines(), "prefill-throughput", "prefill-throughput+overflow"]


# ------------------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    """An instance assumption changed for the sensitivity study (applied to every profile)."""

    name: str = ""
    compute_scale: float = 1.0
    memory_scale: float = 1.0
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # a shorter context: prompts are truncated to it (new queries)

    def apply(self, p: Profile) -> Profile:
        sched = dict(p.scheduler)
        if self.max_num_batched_tokens is not None:
            sched["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.max_model_len is not None:
            sched["max_model_len"] = self.max_model_len
        return dataclasses.replace(p, compute_efficiency=p.compute_efficiency * self.compute_scale,
                                   memory_efficiency=min(1.0, p.memory_efficiency * self.memory_scale),
                                   scheduler=sched)


SENSITIVITY = [
    Variant("prefill-25%", compute_scale=0.75), Variant("prefill+25%", compute_scale=1.25),
    Variant("decode-25%", memory_scale=0.75), Variant("decode+25%", memory_scale=1.25),
    Variant("budget-2048", max_num_batched_tokens=2048), Variant("budget-16384", max_num_batched_tokens=16384),
    # Qwen3's native context (model card: 32,768; config.json's 40,960 leaves room for the output),
    # and shorter deployment limits, all with max_tokens 4,096: GovReport's long tail truncated.
    Variant("context-32k", max_model_len=32_768), Variant("context-16k", max_model_len=16_384),
    Variant("context-8k", max_model_len=8_192),
]


# ------------------------------------------------------------------------------------- setups
@dataclass
class Setup:
    seed: int
    n_queries: int
    queries: QuerySet
    calibration: dict[str, Calibration]
    history: dict[str, list[tuple[float, float | None]]] = field(default_factory=dict)
    pool: list[str] = field(default_factory=lambda: list(PAPER_POOL))
    variant: Variant = field(default_factory=Variant)

    def specs(self) -> list[InstanceSpec]:
        out = []
        for p in self.pool:
            sp = InstanceSpec.from_profile(p)
            out.append(dataclasses.replace(sp, profile=self.variant.apply(sp.profile)))
        return out

    def targets(self) -> np.ndarray:
        return ttft_target_s(self.queries.prompt_tokens[:, 0], np.random.default_rng(self.seed + 2))


def setup(seed: int, n_queries: int, cache: Path | None = None, n_train: int = 3000, n_calib: int = 400,
          variant: Variant | None = None) -> Setup:
    """Predictor trained on synthetic data (seed-disjoint), evaluation and calibration queries,
    per-instance profiling: built once per (seed, n, variant) and cached."""
    variant = variant or Variant()
    cache = cache or default_cache_dir()
    tag = f"-{variant.name}" if variant.name else ""
    path = cache / f"eval-setup-{SETUP_VERSION}-{seed}-{n_queries}-{n_train}-{n_calib}{tag}.pkl"
    if path.exists():
        with open(path, "rb") as f:
            return pickle.load(f)
    pred_dir = trained_predictor_dir(n_train, seed=10_000 + seed, cache=cache)
    specs = [dataclasses.replace(sp, profile=variant.apply(sp.profile))
             for sp in (InstanceSpec.from_profile(p) for p in PAPER_POOL)]
    limit = min(sp.max_prompt_tokens for sp in specs)
    if variant.name and variant.max_model_len is None:  # the seed's queries, profiled on the changed instances
        base = setup(seed, n_queries, cache, n_train, n_calib)
        qs = base.queries
    else:
        qs = build_queries(n_queries, seed=seed, predictor_dir=pred_dir, max_prompt_tokens=limit)
    cal_qs = build_queries(n_calib, seed=20_000 + seed, predictor_dir=pred_dir, max_prompt_tokens=limit)
    prof = calibrate_pool(specs, cal_qs, seed=seed + 3)
    s = Setup(seed=seed, n_queries=n_queries, queries=qs, calibration=prof.calibration, history=prof.history,
              variant=variant)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        pickle.dump(s, f)
    tmp.replace(path)
    return s


# ------------------------------------------------------------------------------------- cells
@dataclass(frozen=True)
class Cell:
    """One simulation: an entry (policy, parameters, estimator) under one arrival setting, on the
    setup of one seed and instance variant."""

    entry: str
    policy: str
    rate: float
    seed: int
    params: tuple[tuple[str, float], ...] = ()
    estimator: tuple[tuple[str, bool | int], ...] = ()
    arrivals: str = "poisson"  # poisson | mmpp | batch
    ratio: float = 1.0  # mmpp: the burst ratio r = α_H / α_L
    batch_size: int = 1  # batch: queries arriving at each instant
    decisions: str = "sequenced"  # sequenced | concurrent (bear.evaluation.cluster)
    window_s: float = 0.0  # concurrent: the arrivals decided on one view
    delay_s: float = 0.0
    max_age_s: float = EstimatorConfig.max_age_s
    lam: float = DEFAULT_LAMBDA
    variant: str = ""

    def estimator_config(self) -> EstimatorConfig:
        return EstimatorConfig(**dict(self.estimator), max_age_s=self.max_age_s)

    @property
    def key(self) -> tuple[int, str]:
        return self.seed, self.variant


def cell(entry: str, rate: float, seed: int, params: dict[str, float] | None = None, **kw: Any) -> Cell:
    """The cell of a comparison entry; ``params`` override the entry's own."""
    e = entries()[entry]
    merged = {**dict(e.params), **(params or {})}
    return Cell(entry=entry, policy=e.policy, rate=rate, seed=seed, params=tuple(sorted(merged.items())),
                estimator=e.estimator, **kw)


ARRIVALS = ("poisson", "mmpp", "batch")


def batch_arrivals(rate: float, size: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival times in batches of ``size`` queries at one instant, the instants a Poisson
    process of ``rate / size`` (mean ``rate`` queries/s): the herd's test — every query of a
    batch is decided at the same moment."""
    if size < 1:
        raise ValueError("batch size must be >= 1")
    starts = poisson_arrivals(rate / size, -(-n // size), rng)
    return np.repeat(starts, size)[:n]


def arrival_times(s: Setup, c: Cell) -> np.ndarray:
    rng = np.random.default_rng(s.seed + 1)
    if c.arrivals == "mmpp":
        return Mmpp2(c.rate, c.ratio).arrivals(s.n_queries, rng)[0]
    if c.arrivals == "batch":
        return batch_arrivals(c.rate, c.batch_size, s.n_queries, rng)
    if c.arrivals != "poisson":
        raise ValueError(f"unknown arrivals {c.arrivals!r} (one of {', '.join(ARRIVALS)})")
    return poisson_arrivals(c.rate, s.n_queries, rng)


def simulate(s: Setup, c: Cell, samples: list[Sample] | None = None,
             verdicts: dict[str, Verdict] | None = None) -> list[Outcome]:
    """The cell's run; ``samples``: filled with the learned predictor's samples; ``verdicts``:
    with each decision's (feasible, P(on time))."""
    q = s.queries
    prices = {m: (float(q.price_in[j]), float(q.price_out[j])) for j, m in enumerate(q.models)}
    cluster = Cluster(s.specs(), s.calibration, seed=s.seed + 4, delay_s=c.delay_s, estimator=c.estimator_config(),
                      prices=prices, history=s.history, decisions=c.decisions, window_s=c.window_s)
    cluster.samples = samples
    outs = cluster.run(q, arrival_times(s, c), s.targets(), make_policy(c.policy, **dict(c.params)), c.lam)
    if verdicts is not None:
        verdicts.update(cluster.verdicts)
    return outs


def run_cell(s: Setup, c: Any) -> dict[str, Any]:
    if hasattr(c, "run"):  # a cell of an experiment kept in its own module (bear.evaluation.prefix)
        return c.run(s)
    samples: list[Sample] = []
    verdicts: dict[str, Verdict] = {}
    outs = simulate(s, c, samples, verdicts)
    res = summary(outs)
    res.update(reliability.summarise(outs, verdicts))
    by_inst: dict[str, list[Outcome]] = {}
    for o in outs:
        by_inst.setdefault(o.instance, []).append(o)
    res["ttft_prediction_by_instance"] = {i: ttft_prediction_error(v) for i, v in sorted(by_inst.items())}
    # the learned predictor on the same chosen instances, and the policy's own estimate on the
    # queries the learned one predicts (it needs observations first)
    learned = [dataclasses.replace(o, predicted_ttft_s=float(p)) for o, p in zip(outs, online_predictions(samples),
                                                                                 strict=True)]
    covered = [o for o, lo in zip(outs, learned, strict=True) if math.isfinite(lo.predicted_ttft_s)]
    res["ttft_prediction_learned"] = ttft_prediction_error(learned)
    res["ttft_prediction_same_queries"] = ttft_prediction_error(covered)
    by_task: dict[str, list[Outcome]] = {}
    for o in outs:
        by_task.setdefault(o.task, []).append(o)
    res["composition_by_task"] = {t: composition(v) for t, v in sorted(by_task.items())}
    return res


_WORKER_SETUPS: dict[tuple[int, str], Setup] = {}


def _init_worker(setups: dict[tuple[int, str], Setup]) -> None:
    _WORKER_SETUPS.clear()
    _WORKER_SETUPS.update(setups)


def _run_in_worker(c: Cell) -> tuple[Cell, dict[str, Any]]:
    return c, run_cell(_WORKER_SETUPS[c.key], c)


def run_cells(setups: dict[tuple[int, str], Setup], cells: Sequence[Cell], workers: int | None = None,
              on_done: Callable[[Cell], None] | None = None) -> dict[Cell, dict[str, Any]]:
    """Every distinct cell once, in a process pool (``workers`` processes; one per core by default)."""
    todo = list(dict.fromkeys(cells))
    workers = workers or min(len(todo), os.cpu_count() or 1)
    results: dict[Cell, dict[str, Any]] = {}
    if workers <= 1:
        for c in todo:
            results[c] = run_cell(setups[c.key], c)
            if on_done:
                on_done(c)
        return results
    # the slowest cells (congested baselines) first, so that the pool does not end on one of them
    todo.sort(key=lambda c: -c.rate)
    with ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(setups,)) as ex:
        for c, res in ex.map(_run_in_worker, todo, chunksize=1):
            results[c] = res
            if on_done:
                on_done(c)
    return results


# ------------------------------------------------------------------------------------- statistics
def spread(values: Iterable[float]) -> dict[str, float]:
    """Mean and range over seeds."""
    v = [float(x) for x in values]
    return {"mean": float(np.mean(v)), "min": float(np.min(v)), "max": float(np.max(v)), "n": len(v)}


def gain_over_best(table: dict[str, list[float]], ours: str, others: Sequence[str]) -> list[float]:
    """Per rate: (ours − best of ``others``) / best of ``others``."""
    out = []
    for k, v in enumerate(table[ours]):
        best = max(table[o][k] for o in others)
        out.append((v - best) / best if best > 0 else math.inf)
    return out


def best_baseline(table: dict[str, list[float]], others: Sequence[str]) -> list[str]:
    return [max(others, key=lambda o: table[o][k]) for k in range(len(next(iter(table.values()))))]
