"""The real-vLLM runs shipped in ``tests/data/vllm-recorded/`` (README there: how and when each was
recorded), replayed deterministically: the fidelity figures the live tests only report — they
depend on how the host times the engine — asserted on a fixed recording of the same tests, so
the verdict is the same on every machine. No vLLM is needed here.

* ``prefix-sessions``: the mirror's hit equals the engine's ``num_cached_tokens`` for ≥ 99 % of
  admitted requests, and libbea reproduces the batch sequence for ≥ 99 % of arrivals with them;
* ``prefix-kv-pressure`` (the plugin's block-op log on): the pool rebuilt from the log equals the
  engine at every step; with the pool's state ≥ 99 % of arrivals replay exactly, as token counts
  fewer than 90 %; and from the states a snapshotter publishes (``published_states``, the
  function the live test checks the snapshotter against), each query keyed by its token ids as
  the estimator keys it: ≥ 99 % exact — and as exact from the states rebuilt from the deltas
  of a snapshotter that keeps the block table step by step (``published_stream``, issue 28);
* ``light`` / ``lpt-queueing`` / ``kv-pressure`` (the every-step tests' runs, as replay cases):
  ≥ 99 % exact, preemptions among the KV-pressure cases."""

from __future__ import annotations

from pathlib import Path

import pytest
from recorded_runs import RECORDED, prefix_fidelity, read_cases, read_prompts, replay_fidelity, save_result

from bear.protocol.jsonl import read_jsonl

pytestmark = [pytest.mark.slow]


def _recording(config: str) -> Path:
    where = RECORDED / config
    if not where.is_dir():
        pytest.fail(f"the recording {where} is missing (it ships with the repository)")
    return where


def _prefix_recording(config: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    rec = _recording(config)
    res = prefix_fidelity(rec / "steps.jsonl.gz", read_prompts(rec / "prompts.json.gz"), config,
                          tmp_path_factory.mktemp(config))
    save_result(f"recorded-{config}", res)
    return res


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _prefix_recording("prefix-sessions", tmp_path_factory)


@pytest.fixture(scope="module")
def kv_pressure(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _prefix_recording("prefix-kv-pressure", tmp_path_factory)


@pytest.mark.parametrize("fixture", ["sessions", "kv_pressure"])
def test_recordings_are_whole(fixture: str, request: pytest.FixtureRequest) -> None:
    """A recording lost no step (the snapshotter kept up while it was made), and every case's hits
    are the mirror's, from BEAR's own tokenisation."""
    res = request.getfixturevalue(fixture)
    assert res["steps_logged"] == res["steps"] and res["cases"] > 200, res
    assert res["cases_with_mirror_hits"] == res["cases"], res


def test_mirror_hits_equal_the_engine_and_make_the_replay_exact(sessions: dict) -> None:
    res, agree = sessions, sessions["hit_agreement"]
    assert agree["rate"] is not None and agree["rate"] >= 0.99, res
    assert res["cases_with_hit"] > 0.5 * res["cases"], res
    hits, none, engine = (res[k] for k in ("replay_with_mirror_hits", "replay_without_hits",
                                           "replay_with_engine_hits"))
    assert hits["exact_frac"] >= 0.99, res
    assert none["exact_frac"] < hits["exact_frac"], res  # the hits are what makes the replay exact
    assert hits["exact_frac"] >= engine["exact_frac"] - 0.05, res  # as good as the engine's own numbers


def test_pool_replica_equals_the_engine_at_every_step(kv_pressure: dict) -> None:
    pr = kv_pressure["pool_replica"]
    assert pr["mismatches"] == 0 and pr["checked"] == pr["steps"], pr
    assert pr["cache_equal_kv_mirror"] >= 0.99 * pr["checked"], pr  # vLLM's KV events agree with the log


def test_kv_pressure_replays_exactly_with_the_pool_state(kv_pressure: dict) -> None:
    """Under KV pressure vLLM charges hit blocks that sit in the free queue against the free count
    and evicts them while admissions allocate: with the pool block by block the replay is exact,
    as token counts it is not."""
    res = kv_pressure
    assert res["replay_with_mirror_hits"]["preemption_cases"] > 0 and res["hit_agreement"]["with_hit"] > 0, res
    assert res["hit_agreement"]["rate"] >= 0.98, res
    assert res["cases_with_tracked_blocks"] == res["cases"], res
    assert res["tracked_hits_equal_mirror"] == res["tracked_hits"] > 0, res
    assert res["replay_with_mirror_hits"]["exact_frac"] >= 0.99, res
    assert res["replay_with_mirror_hit_counts"]["exact_frac"] < 0.9, res  # the pool's state makes it exact


def test_kv_pressure_replays_exactly_from_what_a_live_estimator_holds(kv_pressure: dict) -> None:
    lp = kv_pressure["live_pool"]
    assert lp["published"] == lp["cases"] and lp["described"] == lp["published"], lp
    assert lp["keyed"] >= 0.95 * lp["published"] and lp["ahead"] > 0, lp
    assert lp["exact_frac"] >= 0.99, lp


def test_kv_pressure_replays_as_exactly_from_the_table_kept_by_deltas(kv_pressure: dict) -> None:
    """A snapshotter with ``--pool-deltas`` (issue 28): the estimator's state rebuilt from a full
    snapshot and the deltas after it (libbea applying the table's changes) replays every case as
    the full description of every step does."""
    lp, ld = kv_pressure["live_pool"], kv_pressure["live_pool_deltas"]
    assert ld["published"] == ld["described"] == lp["published"], ld
    assert ld["deltas_applied"] > 10 * ld["from_full"] and ld["from_full"] < ld["published"], ld
    # (keyed: the first state's table lists its free blocks, so its query is keyed too)
    assert ld["keyed"] >= lp["keyed"] and ld["ahead"] == lp["ahead"], (ld, lp)
    assert ld["exact"] >= lp["exact"] and ld["exact_frac"] >= 0.99, (ld, lp)


@pytest.mark.parametrize("config", ["light", "lpt-queueing", "kv-pressure"])
def test_every_step_recordings_replay_exactly(config: str) -> None:
    rec = _recording(config)
    cases = read_cases(rec)
    fid = replay_fidelity(cases, list(read_jsonl(rec / f"batches_{config}.jsonl.gz")))
    save_result(f"recorded-{config}", fid)
    assert fid["arrivals"] >= 100, fid
    assert fid["exact_frac_known"] >= 0.99, fid
    assert fid["later_arrival_cases"] <= 0.1 * fid["arrivals"], fid  # counted apart, never many
    if config == "kv-pressure":
        assert fid["preemption_cases"] > 0, fid
