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
