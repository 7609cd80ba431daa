"""Every ``bear bench`` command runs, briefly, as a user runs it (issue 27: ``bear bench gateway``
once failed at its first import and no test noticed; ``bear bench estimator`` and ``bear bench
prefix`` did too, until this test). Each must exit 0 and report figures within physical bounds:
no negative time, size or count, and some time measured. The figures themselves are the
benchmarks' business (docs/results/), never a threshold here. ``bear bench predictor`` has its
own test (tests/predictor/test_predictor_service.py: it needs a trained model). Latencies are not
sign-checked: some are differences (the gateway hop's overhead, gateway minus direct), which noise
can make negative."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

COUNTS = ("n", "sent", "done", "lost", "queries", "hits", "reps", "table_entries", "executed_twice")
SIZES = ("bytes", "bytes_list", "bytes_packed", "duration_s", "wall_s", "recovery_s", "seconds")
# (command, its brief arguments, whether it writes --out JSON)
BENCHES = [
    ("pool", ["--sizes", "1000", "--reps", "1"], True),
    ("estimator", ["--n", "20", "--timing-reps", "20", "--population-reps", "2", "--ingest-steps", "20",
                   "--ingest-passes", "1", "--nats-seconds", "0.5", "--json"], False),
    ("estimator-service", ["--seconds", "1", "--latency-seconds", "0.5", "--instances", "1", "--residents", "4"],
     False),
    ("estimator-accuracy", ["--qps", "2", "--seconds", "5", "--warmup", "2"], False),
    ("prefix", ["--rate", "2", "--duration", "2"], True),
    ("router", ["--rate", "5", "--duration", "2"], True),
    ("gateway", ["--rates", "5", "--duration", "1", "--max-tokens", "4"], True),
    ("relay", ["--tokens", "8", "--answers", "4", "--concurrency", "2", "--step-ms", "5", "--repeat", "1"], True),
    ("faults", ["--faults", "worker-kill", "--rate", "5", "--duration", "3", "--at", "1"], True),
]


def _figures(x: Any, key: str = "") -> list[tuple[str, float]]:
    """Every number in a result, with the path of keys it is under (``ttft_ms.p50``)."""
    if isinstance(x, dict):
        return [f for k, v in x.items() for f in _figures(v, f"{key}.{k}" if key else str(k))]
    if isinstance(x, list):
        return [f for v in x for f in _figures(v, key)]
    if isinstance(x, int | float) and not isinstance(x, bool):
        return [(key, float(x))]
    return []


@pytest.mark.parametrize(("name", "args", "writes"), BENCHES, ids=[b[0] for b in BENCHES])
def test_bench_command_runs_and_reports_physical_figures(name: str, args: list[str], writes: bool,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "bear", "bench", name, *args, *(["--out", str(out)] if writes else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert res.returncode == 0, f"{' '.join(cmd[2:])}:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    assert "Traceback" not in res.stdout + res.stderr
    if writes:
        result = json.loads(out.read_text())
    elif "--json" in args:
        result = json.loads(res.stdout[res.stdout.index("{"):])
    else:  # a table for people: it has numbers in it
        assert any(ch.isdigit() for ch in res.stdout), res.stdout
        return
    figures = _figures(result)
    assert figures, f"no figures in {name}'s result"
    assert not [(k, v) for k, v in figures if math.isinf(v)], "an infinite figure"
    bounded = [(k, v) for k, v in figures if k.rsplit(".", 1)[-1] in COUNTS + SIZES]
    assert not [(k, v) for k, v in bounded if v < 0], [(k, v) for k, v in bounded if v < 0][:5]
    timed = [v for k, v in figures if any(p.endswith(("_ms", "_s", "_us")) for p in k.split("."))]
    assert any(v > 0 for v in timed), figures[:10]


def test_bench_relay_relays_every_token_of_every_answer(tmp_path: Path) -> None:
    """Each relay's CPU figure is over the answers it relayed whole: every token of every
    answer reached the bus, through each of the three relays (the raw one included)."""
    out = tmp_path / "relay.json"
    cmd = [sys.executable, "-m", "bear", "bench", "relay", "--tokens", "12", "--answers", "6", "--concurrency", "3",
           "--step-ms", "2", "--repeat", "1", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(out.read_text())
    assert sorted(r["variant"] for r in result["runs"]) == ["bear", "minimal", "raw"]
    for run in result["runs"]:
        assert run["tokens_relayed"] == 6 * 12 and run["lost"] == 0, run
