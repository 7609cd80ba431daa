"""Fleet scale in virtual time (``bear eval --experiment fleet``, issue 45): the paper's model mix
scaled up to pools of 16, 64 and 256 instances, arrivals scaled to the same load per instance,
BEAR with candidate selection (``bear.router.selection``) against BEAR with every instance a
candidate and against the baselines.

A pool of n instances repeats the paper's three profiles (``PAPER_POOL``, one of each model) in
turn; each copy has its own engine noise seed and name (``<profile>#<k>``) and starts from its
profile's calibration and profiling history, as an operator who profiled one instance of each
kind would. Every profile there is has roofline data for one GPU kind only (H100): the fleet is
heterogeneous in models, not in GPUs. The queries are the seed's setup queries repeated with
fresh ids (the predictor's answers with them), as many as the cell needs; the arrival rate is the
paper's per-instance load (``PER_INSTANCE_RATES`` × n / 3). Bursty arrivals are ``batch``
arrivals (``bear.evaluation.experiments.batch_arrivals``) of n / 4 queries at one instant.

Each cell reports OnTimeUtility and its companions (``bear.load.metrics.summary``), replays per
query (the estimator calls of its decisions), the stages that decided, and decisions per second
of CPU time inside the decision path (``Cluster.decide``: snapshot delivery, the cheap stage, the
replays, candidates, filters, policy — one process, one core).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from bear.evaluation.cluster import PAPER_POOL, Cluster, InstanceSpec
from bear.evaluation.experiments import DEFAULT_LAMBDA, Setup, batch_arrivals, cell, entries
from bear.evaluation.workload import QuerySet
from bear.load.arrivals import poisson_arrivals
from bear.load.metrics import summary
from bear.load.targets import ttft_target_s
from bear.router.policies import make_policy
from bear.router.selection import SelectionConfig

SIZES = (16, 64, 256)
PER_INSTANCE_RATES = (8.0 / 3,)  # the paper's 8 q/s (Figs. 9, 14) on its 3 instances, per instance
ARRIVALS = ("poisson", "batch")
QUERIES_PER_INSTANCE = 8  # queries per cell: this many per instance (3 s of arrivals), at least MIN_QUERIES
MIN_QUERIES = 600
OURS = "bear+overflow"  # the shipped BEAR (extensions and overflow rule)
FLEET_BASELINES = ("routebalance", "score", "latency-agnostic", "round-robin", "shortest-queue", "lmdeploy",
                   "semantic-router")
SELECTED = "bear+select"  # OURS with the cheap first stage
EVERY = "bear+every"  # OURS with every instance replayed


def fleet_specs(n: int) -> list[InstanceSpec]:
    """``n`` instances: the paper's profiles in turn, each copy named ``<profile>#<k>``."""
    base = [InstanceSpec.from_profile(p) for p in PAPER_POOL]
    return [dataclasses.replace(base[k % len(base)], name=f"{base[k % len(base)].name}#{k}") for k in range(n)]


def tiled(qs: QuerySet, n: int) -> QuerySet:
    """``n`` queries: ``qs`` repeated (fresh ids), cut to n."""
    reps = -(-n // len(qs))
    idx = np.tile(np.arange(len(qs)), reps)[:n]
    return QuerySet(ids=[f"{qs.ids[i]}~{k}" for k, i in enumerate(idx)], tasks=[qs.tasks[i] for i in idx],
                    models=list(qs.models), prompt_tokens=qs.prompt_tokens[idx], true_quality=qs.true_quality[idx],
                    true_output=qs.true_output[idx], pred_acc=qs.pred_acc[idx], pred_len=qs.pred_len[idx],
                    pred_p90=qs.pred_p90[idx], price_in=qs.price_in, price_out=qs.price_out)


def n_queries(size: int) -> int:
    return max(MIN_QUERIES, QUERIES_PER_INSTANCE * size)


@dataclass(frozen=True)
class FleetCell:
    """One fleet simulation: a router (``entries()`` name, or SELECTED / EVERY), a pool size, a
    per-instance rate, an arrival kind, a query count. Only SELECTED runs the cheap first stage:
    EVERY and the baselines replay every instance, as the shipped router does."""

    router: str
    size: int
    rate_per_instance: float
    arrivals: str
    seed: int
    queries: int

    @property
    def key(self) -> tuple[int, str]:
        return self.seed, ""

    @property
    def rate(self) -> float:
        """The pool's arrival rate (q/s; the process pool starts the largest first)."""
        return self.rate_per_instance * self.size

    @property
    def entry(self) -> str:
        return OURS if self.router in (SELECTED, EVERY) else self.router

    def run(self, s: Setup) -> dict[str, Any]:
        specs = fleet_specs(self.size)
        calib = {sp.name: msgspec.structs.replace(s.calibration[sp.profile.name], instance=sp.name) for sp in specs}
        history = {sp.name: s.history.get(sp.profile.name, []) for sp in specs}
        qs = tiled(s.queries, self.queries)
        rng = np.random.default_rng(s.seed + 1)
        rate = self.rate
        times = (batch_arrivals(rate, max(1, self.size // 4), len(qs), rng) if self.arrivals == "batch"
                 else poisson_arrivals(rate, len(qs), rng))
        targets = ttft_target_s(qs.prompt_tokens[:, 0], np.random.default_rng(s.seed + 2))
        e = cell(self.entry, rate, s.seed)
        prices = {m: (float(qs.price_in[j]), float(qs.price_out[j])) for j, m in enumerate(qs.models)}
        cl = Cluster(specs, calib, seed=s.seed + 4, estimator=e.estimator_config(), prices=prices, history=history,
                     selection=SelectionConfig() if self.router == SELECTED else None)
        w0 = time.perf_counter()
        outs = cl.run(qs, times, targets, make_policy(e.policy, **dict(e.params)), DEFAULT_LAMBDA)
        res = summary(outs)
        res.update(
            wall_s=time.perf_counter() - w0, queries=len(outs), virtual_s=float(times[-1]),
            replays_per_query=float(np.mean([o.replayed for o in outs])),
            considered_per_query=float(np.mean([o.considered for o in outs])),
            stages=dict(Counter(o.stage for o in outs)),
            decide_cpu_s=cl.decide_cpu_s,
            decisions_per_cpu_s=len(outs) / cl.decide_cpu_s if cl.decide_cpu_s > 0 else math.inf)
        return res


def fleet_routers() -> list[str]:
    return [SELECTED, EVERY, *(b for b in FLEET_BASELINES if b in entries())]


def fleet_cells(seeds: Sequence[int]) -> list[FleetCell]:
    return [FleetCell(r, size, rate, arr, s, n_queries(size))
            for s in seeds[:1] for size in SIZES for arr in ARRIVALS for rate in PER_INSTANCE_RATES
            for r in fleet_routers()]


def fleet_result(res: dict[Any, dict[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """Per arrival kind, pool size and rate: each router's figures; BEAR with selection against
    BEAR with every instance (on the same queries where both ran on them) and the best baseline."""
    rows: list[dict[str, Any]] = []
    for c in fleet_cells(seeds):
        r = res[c]
        rows.append({"router": c.router, "size": c.size, "rate_per_instance": c.rate_per_instance,
                     "rate": c.rate_per_instance * c.size, "arrivals": c.arrivals, "queries": c.queries,
                     **{k: r[k] for k in ("on_time_utility", "slo_attainment", "mean_ttft_s", "replays_per_query",
                                          "considered_per_query", "stages", "decisions_per_cpu_s", "decide_cpu_s",
                                          "wall_s", "virtual_s")}})
    return {"seeds": list(seeds[:1]), "sizes": list(SIZES), "rates_per_instance": list(PER_INSTANCE_RATES),
            "arrivals": list(ARRIVALS), "routers": fleet_routers(), "selection": dataclasses.asdict(SelectionConfig()),
            "queries_per_instance": QUERIES_PER_INSTANCE, "min_queries": MIN_QUERIES, "rows": rows,
            "select_vs_every": _versus(rows, EVERY), "select_vs_best_baseline": _versus(rows, None)}


def _versus(rows: list[dict[str, Any]], other: str | None) -> list[dict[str, Any]]:
    """Per (arrivals, size, rate): SELECTED's OnTimeUtility relative to ``other``'s (None: the
    best baseline's), (ours − theirs) / theirs."""
    out = []
    for r in rows:
        if r["router"] != SELECTED:
            continue
        same = [x for x in rows if (x["arrivals"], x["size"], x["rate"]) == (r["arrivals"], r["size"], r["rate"])]
        them = [x for x in same if x["router"] == other] if other else [x for x in same if x["router"] in FLEET_BASELINES]
        if not them:
            continue
        best = max(them, key=lambda x: x["on_time_utility"])
        theirs = best["on_time_utility"]
        out.append({"arrivals": r["arrivals"], "size": r["size"], "rate": r["rate"], "versus": best["router"],
                    "ours": r["on_time_utility"], "theirs": theirs,
                    "gain": (r["on_time_utility"] - theirs) / theirs if theirs > 0 else math.inf})
    return out
