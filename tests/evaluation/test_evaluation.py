"""The evaluation harness: eq. 6 on a hand-built trace, conservation and determinism of runs."""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import numpy as np
import pytest

from bear.evaluation.cluster import PAPER_POOL, Cluster, InstanceSpec, calibrate_pool
from bear.evaluation.workload import QuerySet
from bear.load.metrics import Outcome, composition, on_time_utility, slo_attainment, summary
from bear.protocol.messages import Calibration
from bear.router.policies import make_policy


def test_on_time_utility_eq6_hand_built() -> None:
    outs = [
        Outcome("a", "alpaca", "i1", "m1", target_s=0.2, ttft_s=0.1, utility=0.8, predicted_ttft_s=0.1),
        Outcome("b", "alpaca", "i1", "m1", target_s=0.2, ttft_s=0.3, utility=0.9, predicted_ttft_s=0.1),
        Outcome("c", "govreport", "i2", "m2", target_s=0.5, ttft_s=0.5, utility=-0.1, predicted_ttft_s=math.nan),
        Outcome("d", "govreport", "i2", "m2", target_s=0.5, ttft_s=math.inf, utility=0.7, predicted_ttft_s=0.2),
    ]
    # (0.8 + 0 + (−0.1) + 0) / 4: misses count zero, on-time negative utilities count as they are
    assert on_time_utility(outs) == pytest.approx(0.7 / 4)
    assert slo_attainment(outs) == pytest.approx(0.5)
    comp = composition(outs)
    assert comp["i1"] == {"share": 0.5, "on_time_share": 0.5}
    s = summary(outs)
    assert s["ttft_prediction"]["n"] == 2


def tiny_queries(n: int, seed: int = 0) -> QuerySet:
    rng = np.random.default_rng(seed)
    models = ["Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B"]
    m = len(models)
    prompt = rng.integers(20, 3000, size=(n, 1)).repeat(m, axis=1)
    out = rng.integers(5, 400, size=(n, m))
    qual = np.clip(np.array([0.4, 0.8, 0.9]) + rng.normal(0, 0.05, size=(n, m)), 0, 1)
    return QuerySet(
        ids=[f"t{i}" for i in range(n)], tasks=["alpaca"] * n, models=models, prompt_tokens=prompt,
        true_quality=qual, true_output=out, pred_acc=qual + rng.normal(0, 0.05, size=(n, m)),
        pred_len=out * rng.lognormal(0, 0.3, size=(n, m)), pred_p90=out * 2.0,
        price_in=np.array([0.044, 0.072, 0.287]), price_out=np.array([0.173, 0.287, 0.640]),
    )


@functools.lru_cache(maxsize=1)
def calib() -> dict[str, Calibration]:
    """The pool's calibration as bear eval makes it (profiling runs through robust_fit)."""
    specs = [InstanceSpec.from_profile(p) for p in PAPER_POOL]
    return calibrate_pool(specs, tiny_queries(300, seed=9), seed=1).calibration


def run(policy: str, seed: int, n: int = 300, rate: float = 12.0, delay: float = 0.0):
    qs = tiny_queries(n)
    times = np.cumsum(np.random.default_rng(1).exponential(1 / rate, n))
    targets = np.full(n, 0.25)
    specs = [InstanceSpec.from_profile(p) for p in PAPER_POOL]
    return Cluster(specs, calib(), seed=seed, delay_s=delay).run(qs, times, targets, make_policy(policy), 5e-4)


@pytest.mark.parametrize("policy", ["bear", "round-robin", "semantic-router", "routebalance"])
def test_every_query_routed_once_and_answered(policy: str) -> None:
    outs = run(policy, seed=3)
    assert len(outs) == 300
    assert len({o.query_id for o in outs}) == 300
    assert all(math.isfinite(o.ttft_s) and o.ttft_s > 0 for o in outs)  # every query got its first token


def test_runs_are_deterministic_per_seed() -> None:
    a = summary(run("bear", seed=5, n=200))
    b = summary(run("bear", seed=5, n=200))
    c = summary(run("bear", seed=6, n=200))
    assert a == b
    assert a["mean_ttft_s"] != c["mean_ttft_s"]  # the engines' noise follows the seed


def test_bear_predictions_track_observed_ttft() -> None:
    s = summary(run("bear", seed=2, n=300))
    assert s["ttft_prediction"]["n"] == 300
    assert s["ttft_prediction"]["mape"] < 0.35


def test_stale_snapshots_still_route_every_query() -> None:
    outs = run("bear", seed=4, n=200, delay=0.4)
    assert len(outs) == 200 and all(math.isfinite(o.ttft_s) for o in outs)


def test_staleness_router_sees_snapshots_at_least_delay_old() -> None:
    specs = [InstanceSpec.from_profile(PAPER_POOL[0])]
    cl = Cluster(specs, calib(), seed=1, delay_s=0.1)
    inst = cl.insts[0]
    for k in range(40):  # keep the engine busy so that it publishes a snapshot per step
        cl.submit(0, f"r{k}", 500, 50, 0.001 * k)
        cl.advance_to(0.001 * k)
    cl.advance_to(0.5)
    published = [t for t, _ in inst.snaps]
    assert len(published) > 5
    for t in np.linspace(0.15, 0.5, 30):
        seen, _ = inst.visible(t - cl.delay_s)
        assert seen <= t - cl.delay_s
        newer = [p for p in published if p <= t - cl.delay_s]
        assert seen == max(newer)  # the newest one that is old enough


@pytest.mark.slow
def test_eval_cli_json_contract(tmp_path) -> None:
    """`bear eval --experiment rates --seed S --json` prints the result on a clean stdout (other
    tools parse it: rates, OnTimeUtility per entry with mean/min/max, gains) and writes the JSON
    and the PNGs."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "bear", "eval", "--experiment", "rates", "--seed", "3", "--rates", "6,12",
         "--n-queries", "200", "--workers", "1", "--json", "--out", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=600,
    )
    doc = json.loads(out.stdout)
    assert doc["rates"] == [6.0, 12.0] and doc["seeds"] == [3]
    assert {"bear", "bear+ext", "routebalance", "prefill-throughput"} <= set(doc["on_time_utility"])
    assert all(0.0 <= v <= 1.0 for e in doc["on_time_utility"].values() for v in e["mean"])
    assert len(doc["gains"]["bear"]["mean"]) == 2
    assert (tmp_path / "rates.json").exists() and (tmp_path / "rates.png").stat().st_size > 10_000
    assert (tmp_path / "rates-composition.png").exists()


def test_eval_writes_under_results_of_the_current_directory(tmp_path, monkeypatch) -> None:
    """Without ``--out``, ``bear eval`` writes under ``./results/<UTC date>/`` of the directory it
    runs in (ignored by git), never into a checkout's docs/results/; ``--out`` still wins. The
    simulation itself is replaced: only the folder handed to it is checked."""
    from typer.testing import CliRunner

    from bear.cli import app
    from bear.evaluation import run as runner

    got: list[Path] = []
    monkeypatch.setattr(runner, "run", lambda names, seeds, n, out, **kw: got.append(out) or {})
    monkeypatch.chdir(tmp_path)
    for args, tail in ((["--experiment", "rates", "--seed", "5"], ("rates-5",)),
                       (["--experiment", "estimator", "--seeds", "7,8"], ("estimator-7-8",)),
                       (["--experiment", "all"], ())):
        before = time.strftime("%Y-%m-%d", time.gmtime())
        res = CliRunner().invoke(app, ["eval", *args])
        days = {before, time.strftime("%Y-%m-%d", time.gmtime())}  # a run across UTC midnight
        assert res.exit_code == 0, res.output
        assert got[-1] in {Path("results", d, *tail) for d in days}, got[-1]
        assert not got[-1].is_absolute()  # relative: under the current directory
    res = CliRunner().invoke(app, ["eval", "--experiment", "rates", "--out", "elsewhere"])
    assert res.exit_code == 0 and got[-1] == Path("elsewhere"), res.output
    assert list(tmp_path.iterdir()) == []  # the replaced run wrote nothing; no docs/ appeared
