"""Candidate selection in ``bear eval``'s pool and the fleet experiment (issue 45): on the paper's
pool the selection stage changes nothing (outcome for outcome); with k_max at least every model's
instance count it is BEAR on every instance exactly; otherwise every decision replays at most
k_max instances per model, all considered, and every outcome says which stage decided. All in
virtual time: nothing depends on the host's timing."""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np
from test_evaluation import calib, tiny_queries

from bear.commands.evaluation import EXPERIMENTS
from bear.estimator.estimate import EstimatorConfig
from bear.evaluation import fleet
from bear.evaluation.cluster import PAPER_POOL, Cluster, InstanceSpec
from bear.evaluation.experiments import Setup
from bear.evaluation.suite import registry
from bear.router.policies import make_policy
from bear.router.selection import STAGE_EVERY, STAGE_SELECTED, SelectionConfig


def _run(specs: list[InstanceSpec], selection: SelectionConfig | None, policy: str = "bear", n: int = 120,
         rate_per_instance: float = 8.0 / 3):
    cal = calib()
    c = {sp.name: msgspec.structs.replace(cal[sp.profile.name], instance=sp.name) for sp in specs}
    qs = fleet.tiled(tiny_queries(60, seed=2), n)
    times = np.cumsum(np.random.default_rng(5).exponential(1 / (rate_per_instance * len(specs)), n))
    cl = Cluster(specs, c, seed=7, estimator=EstimatorConfig(), selection=selection)
    return cl, cl.run(qs, times, np.full(n, 0.3), make_policy(policy), 5e-4)


def test_on_the_paper_pool_selection_changes_nothing() -> None:
    specs = [InstanceSpec.from_profile(p) for p in PAPER_POOL]
    _, every = _run(specs, None, n=200)
    _, sel = _run(specs, SelectionConfig(), n=200)
    assert sel == every  # outcome for outcome: instance, TTFT, utility, estimate, stage
    assert {o.stage for o in sel} == {STAGE_EVERY} and all(o.replayed == o.considered == 3 for o in sel)


def test_k_max_at_least_the_pool_is_every_instance_exactly() -> None:
    specs = fleet.fleet_specs(16)
    _, every = _run(specs, None)
    _, wide = _run(specs, SelectionConfig(k_max=16, k_min=2))
    assert wide == every
    assert all(o.replayed == 16 for o in wide)


def test_selection_replays_at_most_k_max_per_model_and_records_the_stage() -> None:
    specs = fleet.fleet_specs(24)  # 8 instances of each model
    cfg = SelectionConfig(k_max=3, k_min=1)
    cl, outs = _run(specs, cfg)
    assert len(outs) == 120 and all(np.isfinite(o.ttft_s) for o in outs)
    assert all(o.stage == STAGE_SELECTED and o.considered == 24 and 3 <= o.replayed <= 9 for o in outs)
    for o in outs:  # the chosen instance was one the replay stage estimated
        assert o.instance in cl.selections[o.query_id].replay
    # a policy that reads no estimate is decided without the replay stage
    _, rr = _run(specs, cfg, policy="round-robin")
    assert all(o.stage == "none" and o.replayed == 0 and o.considered == 24 for o in rr)


def test_fleet_pool_repeats_the_paper_mix() -> None:
    specs = fleet.fleet_specs(64)
    assert len({s.name for s in specs}) == 64
    per = Counter(s.model for s in specs)
    assert set(per) == {InstanceSpec.from_profile(p).model for p in PAPER_POOL}
    assert max(per.values()) - min(per.values()) <= 1


def test_tiled_queries_repeat_with_fresh_ids() -> None:
    qs = tiny_queries(7, seed=1)
    t = fleet.tiled(qs, 20)
    assert len(t) == 20 and len(set(t.ids)) == 20
    assert np.array_equal(t.prompt_tokens[7:14], qs.prompt_tokens)


def test_fleet_experiment_is_registered_and_runs_a_cell() -> None:
    assert "fleet" in EXPERIMENTS and "fleet" in registry()
    cells = registry()["fleet"].cells([11])
    assert {c.size for c in cells} == set(fleet.SIZES) and {c.arrivals for c in cells} == set(fleet.ARRIVALS)
    assert {c.router for c in cells} == set(fleet.fleet_routers())
    s = Setup(seed=11, n_queries=60, queries=tiny_queries(60, seed=3), calibration=calib())
    res = {}
    for router in (fleet.SELECTED, fleet.EVERY, "round-robin"):
        c = fleet.FleetCell(router, 16, 8.0 / 3, "batch", 11, 80)
        res[router] = c.run(s)
        assert res[router]["queries"] == 80
    assert res[fleet.EVERY]["replays_per_query"] == 16 and res[fleet.EVERY]["stages"] == {STAGE_EVERY: 80}
    assert res[fleet.SELECTED]["replays_per_query"] <= 3 * SelectionConfig().k_max
    assert res["round-robin"]["replays_per_query"] == 0
