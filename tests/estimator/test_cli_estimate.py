"""The CLI contract other tools depend on: `bear estimate`, `bear calibrate`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bea_helpers import decoding, req, snapshot


def bear(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bear", *args], capture_output=True, text=True, check=True)


def test_estimate_single_json(tmp_path: Path) -> None:
    snap = tmp_path / "s.json"
    snap.write_text(json.dumps(snapshot([req("A", 100, c=109, o=10, blocks=7), req("X", 5000, c=2048, blocks=128)],
                                        free=1000)))
    request = tmp_path / "r.json"
    request.write_text(json.dumps({"id": "T", "prompt_tokens": 3000, "max_tokens": 10}))
    lengths = tmp_path / "l.json"
    lengths.write_text(json.dumps({"A": 500, "X": 500}))
    coeffs = tmp_path / "c.json"
    coeffs.write_text(json.dumps({"beta": [1.0, 0.0, 0.0, 0.0]}))
    out = bear("estimate", "--snapshot", str(snap), "--request", str(request), "--lengths", str(lengths),
               "--coeffs", str(coeffs), "--trace", "--json")
    doc = json.loads(out.stdout)
    assert doc["ttft_s"] == 3.0 and doc["n_batches"] == 3
    assert doc["batches"][2] == {"A": 1, "X": 1, "T": 1858}
    plain = json.loads(bear("estimate", "--snapshot", str(snap), "--request", str(request), "--lengths",
                            str(lengths), "--coeffs", str(coeffs), "--json").stdout)
    assert set(plain) == {"ttft_s", "n_batches"}


def test_calibrate_then_estimate_cases(tmp_path: Path, traces_dir: Path) -> None:
    out = tmp_path / "beta.json"
    bear("calibrate", "--batches", str(traces_dir / "batches_f.jsonl.gz"), "--out", str(out))
    cal = json.loads(out.read_text())
    assert len(cal["beta"]) == 4 and all(b >= 0 for b in cal["beta"]) and cal["n"] > 1000
    assert 0 < cal["mape"] < 0.3
    res = bear("estimate", "--cases", str(traces_dir / "cases.jsonl.gz"), "--coeffs", str(out), "--trace", "--json")
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert len(lines) == 200
    assert {"request", "ttft_s", "n_batches", "batches"} <= set(lines[0])
    assert all(isinstance(x["ttft_s"], float) for x in lines)


def test_calibrate_several_files(tmp_path: Path, traces_dir: Path) -> None:
    out = tmp_path / "beta.json"
    bear("calibrate", "--batches", str(traces_dir / "batches_e.jsonl.gz"), str(traces_dir / "batches_f.jsonl.gz"),
         "--out", str(out))
    assert json.loads(out.read_text())["n"] > 10000
    _ = decoding  # helper shared with the other tests
