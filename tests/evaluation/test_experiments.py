"""The experiment machinery: frozen baseline configuration, entries as parameters (no policy
special-cased), determinism per seed, the experiment list, the statistics over seeds."""

from __future__ import annotations

import json

import pytest
from test_evaluation import calib, tiny_queries

from bear.commands.evaluation import EXPERIMENTS
from bear.evaluation import experiments as ex
from bear.evaluation import run as runner
from bear.evaluation.suite import registry
from bear.router.policies import REGISTRY


def test_tuned_baselines_are_frozen_in_the_configuration() -> None:
    cfg = ex.load_config()
    tuning = cfg["tuning"]
    assert tuning["seed"] not in ex.HEADLINE_SEEDS  # tuned on a separate seed
    assert set(tuning["grid"]) == set(tuning["chosen"])
    es = ex.entries()
    for name, chosen in tuning["chosen"].items():
        assert dict(es[name].params) == chosen  # what runs is what the tuning chose
        for k, v in chosen.items():
            assert v in tuning["grid"][name][k]
    # the rates experiment runs each baseline once, at its frozen configuration: no grid, no re-tuning
    cells = registry()["rates"].cells([ex.HEADLINE_SEEDS[0]])
    for name, chosen in tuning["chosen"].items():
        params = {c.params for c in cells if c.entry == name}
        assert params == {tuple(sorted(chosen.items()))}


def test_what_runs_is_read_from_the_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frozen parameters come from comparison.json, not from code: change the file's values and
    the rates cells change with them; `all` never runs the tuning grid."""
    cfg = json.loads(ex.CONFIG.read_text())
    cfg["entries"]["routebalance"]["params"] = {"w_cost": 2.0, "w_latency": 4.0}
    cfg["entries"]["score"]["params"] = {"gamma": 0.3}
    monkeypatch.setattr(ex, "load_config", lambda path=ex.CONFIG: cfg)
    cells = registry()["rates"].cells([ex.HEADLINE_SEEDS[0]])
    assert {c.params for c in cells if c.entry == "routebalance"} == {(("w_cost", 2.0), ("w_latency", 4.0))}
    assert {c.params for c in cells if c.entry == "score"} == {(("gamma", 0.3),)}
    assert "tune" not in runner.ALL


def test_entries_are_registry_policies_with_parameters() -> None:
    es = ex.entries()
    assert {"bear", "bear+ext", "prefill-throughput"} <= set(es)
    for e in es.values():
        assert e.policy in REGISTRY and e.role in ("ours", "baseline", "ablation")
    # BEAR as the paper describes it and with the extensions differ only in the estimator flags
    assert es["bear"].policy == es["bear+ext"].policy and es["bear"].params == es["bear+ext"].params
    assert not any(dict(es["bear"].estimator).values()) and all(dict(es["bear+ext"].estimator).values())
    assert set(ex.baselines()) == {"routebalance", "score", "latency-agnostic", "round-robin", "shortest-queue",
                                   "lmdeploy", "semantic-router"}
    c = ex.cell("bear+ext", 8.0, 1)
    cfg = c.estimator_config()
    assert cfg.compensate_staleness and cfg.use_dispatches and cfg.arrival_fill
    assert not ex.cell("bear", 8.0, 1).estimator_config().arrival_fill


def test_experiment_list_matches_the_cli() -> None:
    assert sorted(EXPERIMENTS) == sorted(runner.experiment_names())
    assert set(runner.ALL) <= set(EXPERIMENTS) and set(runner.ALL) <= set(runner.PLOTS)


def tiny_setup(seed: int) -> ex.Setup:
    return ex.Setup(seed=seed, n_queries=150, queries=tiny_queries(150, seed=seed), calibration=calib())


@pytest.mark.parametrize("entry", ["bear", "bear+ext", "semantic-router"])
def test_cells_are_deterministic_per_seed(entry: str) -> None:
    a = ex.run_cell(tiny_setup(3), ex.cell(entry, 10.0, 3))
    b = ex.run_cell(tiny_setup(3), ex.cell(entry, 10.0, 3))
    c = ex.run_cell(tiny_setup(4), ex.cell(entry, 10.0, 4))
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
    assert a["mean_ttft_s"] != c["mean_ttft_s"]


def test_profiling_history_warms_the_observed_latencies() -> None:
    s = tiny_setup(5)
    s.history = {"qwen3-8b-h100": [(0.2, 0.01), (0.3, 0.02), (0.25, None)]}
    cl = ex.Cluster(s.specs(), s.calibration, seed=1, history=s.history)
    obs = {i.id: i.obs for i in cl.infos}
    assert list(obs["qwen3-8b-h100"].observed) == [0.2, 0.3, 0.25] and len(obs["qwen3-8b-h100"].tpots) == 2
    assert not obs["qwen3-0.6b-h100"].observed
    assert obs["qwen3-8b-h100"].throughput_rps(1.0) == 0.0  # history is not counted as completions


def test_gains_and_spread() -> None:
    table = {"ours": [1.2, 0.5], "a": [1.0, 0.6], "b": [0.8, 0.4]}
    assert ex.gain_over_best(table, "ours", ["a", "b"]) == pytest.approx([0.2, -1 / 6])
    assert ex.best_baseline(table, ["a", "b"]) == ["a", "a"]
    assert ex.spread([1.0, 3.0, 2.0]) == {"mean": 2.0, "min": 1.0, "max": 3.0, "n": 3}


def test_variants_change_only_what_they_name() -> None:
    from bear.sim.profile import load_profile

    p = load_profile("qwen3-8b-h100")
    v = ex.Variant("x", compute_scale=0.5, max_num_batched_tokens=2048)
    q = v.apply(p)
    assert q.compute_efficiency == pytest.approx(p.compute_efficiency / 2)
    assert q.memory_efficiency == p.memory_efficiency
    assert q.engine_config()["max_num_batched_tokens"] == 2048 and p.engine_config()["max_num_batched_tokens"] == 8192


def test_setups_are_deterministic_per_seed(tmp_path) -> None:
    """A setup built twice from nothing (predictor training, queries, profiling) is the same, and
    a run on it gives the same result; another seed gives other queries."""
    import msgspec
    import numpy as np

    a = ex.setup(7, 60, cache=tmp_path / "a", n_train=120, n_calib=30)
    b = ex.setup(7, 60, cache=tmp_path / "b", n_train=120, n_calib=30)
    c = ex.setup(8, 60, cache=tmp_path / "c", n_train=120, n_calib=30)
    for f in ("prompt_tokens", "pred_acc", "pred_len", "true_output", "true_quality"):
        assert np.array_equal(getattr(a.queries, f), getattr(b.queries, f)), f
    assert not np.array_equal(a.queries.prompt_tokens, c.queries.prompt_tokens)
    def fitted(s: ex.Setup) -> dict:  # the fit, not the wall-clock time it was made
        return {k: msgspec.structs.replace(v, updated=0.0) for k, v in s.calibration.items()}

    assert fitted(a) == fitted(b) and a.history == b.history
    cell = ex.cell("bear", 6.0, 7)
    assert json.dumps(ex.run_cell(a, cell), sort_keys=True, default=str) == \
        json.dumps(ex.run_cell(b, cell), sort_keys=True, default=str)
