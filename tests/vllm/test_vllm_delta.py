"""The plugin's per-step deltas against vLLM's real scheduler, without a model: the offline driver
(``offline_scheduler.py``, run with the vLLM venv's Python) feeds a real ``Scheduler`` subclass
random workloads — bursts, shared prefixes, chunked prefill, long-prefill threshold, KV pressure
with preemptions (prefix caching on and off), no chunked prefill, aborts between steps and while a
batch runs, EOS stops, prefix-cache resets that preempt every running request, and (``--chaos``)
reorderings of vLLM's queues that no mirror rule describes — with BEAR_SNAPSHOT_VERIFY=1; the
snapshotter's decoder compares its mirror with the full state after every step."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DRIVER = Path(__file__).with_name("offline_scheduler.py")
CONFIGS = ["prefix-lpt", "kv-pressure-prefix", "kv-pressure", "no-chunking"]


def _run(vllm_py: str, model: Path, *args: str) -> dict:
    out = subprocess.run([vllm_py, str(DRIVER), "verify", str(model), *args], capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config", CONFIGS)
def test_offline_mirror_equals_full_state_every_step(config: str, vllm_py: str, tiny_model: Path) -> None:
    res = _run(vllm_py, tiny_model, "--config", config, "--mode", "verify", "--steps", "1500", "--seed", "21", "--chaos")
    dec, kinds = res["decoder"], res["records"]
    assert dec["mismatches"] == 0 and dec["undecodable"] == 0, res
    # every step after the first is verified, except where the plugin itself saw its mirror
    # disagree with vLLM (the chaos reorderings) and wrote a full record instead
    assert dec["verified"] == res["steps"] - 1 - kinds.get("check", 0), res
    assert 0 < kinds.get("check", 0) <= res["chaos"], res
    assert res["preemptions"] > 0 and res["aborts"] > 0 and res["prefix_resets"] > 0, res
    if config != "kv-pressure":
        assert res["prefix_hit_admissions"] > 0, res


def test_offline_deltas_decode_without_verify_records(vllm_py: str, tiny_model: Path) -> None:
    """The production mode (deltas, a full record every 256 steps): every step decodes, the
    periodic comparisons agree."""
    res = _run(vllm_py, tiny_model, "--config", "prefix-lpt", "--mode", "delta", "--steps", "1500", "--seed", "22")
    dec, kinds = res["decoder"], res["records"]
    assert dec["mismatches"] == 0 and dec["undecodable"] == 0 and dec["verified"] >= 4, res
    assert kinds.get("delta", 0) >= 0.99 * (res["steps"] - 10) and "check" not in kinds, res


@pytest.mark.parametrize("config", ["kv-pressure-prefix", "no-chunking"])
def test_forwarded_plugin_deltas_applied_by_libbea_equal_the_full_state(config: str, vllm_py: str, tiny_model: Path,
                                                                        tmp_path: Path) -> None:
    """The bear.delta/1 the snapshotter forwards from each plugin delta (one decoder, no diff of two
    states), applied by libbea to the previous step's full snapshot, is the full snapshot of the
    step, on vLLM's real scheduler."""
    import gzip
    import marshal

    from delta_check import check_plugin_deltas

    dump = tmp_path / "records.marshal.gz"
    _run(vllm_py, tiny_model, "--config", config, "--mode", "verify", "--steps", "800", "--seed", "23", "--chaos",
         "--dump", str(dump))
    with gzip.open(dump, "rb") as f:
        meta, raws = marshal.load(f)
    res = check_plugin_deltas(raws, meta["config"])
    checks = sum(1 for r in raws if r[20] == 4)
    assert res["differences"] == [] and res["forwarded"] == res["applied_equal"] == len(raws) - 1 - checks, res


def test_a_reader_that_attaches_late_knows_every_request_from_the_resync_dump(vllm_py: str, tiny_model: Path,
                                                                                tmp_path: Path) -> None:
    """With the block-op log, the full record a reader asks for (a snapshotter that attached late
    or lost records) carries the block names of every request the scheduler holds, not only the
    pool: from that record on, a ``TrackedPool`` knows every request with a full block — those
    added before the record included — so none is replayed by counts."""
    import gzip
    import marshal
    import os

    from bear.prefix.tracked_pool import TrackedPool
    from bear.snapshotter.step_decoder import StepDecoder

    dump = tmp_path / "records.marshal.gz"
    out = subprocess.run([vllm_py, str(DRIVER), "verify", str(tiny_model), "--config", "kv-pressure-prefix",
                          "--mode", "delta", "--steps", "600", "--seed", "23", "--resync-at", "300",
                          "--dump", str(dump)],
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "BEAR_SNAPSHOT_BLOCK_OPS": "1"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    with gzip.open(dump, "rb") as f:
        meta, records = marshal.load(f)
    start = next(i for i, raw in enumerate(records) if raw[20] == 3)  # FULL_RESYNC: the late reader's first
    pool = TrackedPool(int(meta["config"]["num_gpu_blocks"]))
    dec = StepDecoder()
    before: set[str] = set()  # requests added before the resync record, still there after it
    seen = set()
    checked = 0
    for k, raw in enumerate(records[start:]):
        step = dec.decode(raw)
        assert step is not None, dec.last_problem
        assert pool.step(step), pool.problem
        rows = [*step["running"], *step["waiting"]]
        if k == 0:
            before = {r[0] for r in rows if r[1] >= 128}
        for r in rows:
            if r[1] >= 128:  # a full block of 128 tokens: vLLM has named it
                assert r[0] in pool.names, (step["seq"], r[0])
                checked += 1
                seen.add(r[0])
    assert before and checked > 0, (before, checked)
