"""``bear diagnose-live`` (bear.calibrator.live_error) on a generated outcome log: the parts sum to
the observed TTFT, the residual and the path fit are as documented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bear.calibrator.live_error import decompose, read_log


def _rec(inst: str, observed: float, elapsed: float, engine: float, path: float, n: int = 50) -> dict:
    c = {"method": "bea", "ttft": elapsed + engine + path, "ttft_elapsed": elapsed, "ttft_path": path,
         "prompt_tokens": n}
    return {"status": "done", "instance": inst, "observed_ttft_s": observed, "instance_prompt_tokens": n,
            "candidates": {inst: c}}


def test_decomposition_sums(tmp_path: Path) -> None:
    recs = [_rec("a", 0.030 + 0.001 * (i % 5), 0.001, 0.010, 0.0) for i in range(40)]
    recs += [_rec("b", 0.050, 0.002, 0.030, 0.015) for _ in range(10)]
    recs += [{"status": "first_token_timeout", "instance": "a"}, _rec("a", 0.1, 0, 0.05, 0) | {"status": "broken"}]
    log = tmp_path / "outcomes.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in recs) + "\nnot json\n")
    t = decompose(read_log(log))
    a, b = t["a"], t["b"]
    assert a["n"] == 40 and b["n"] == 10
    for r in (a, b):
        assert r["elapsed_s"] + r["engine_s"] + r["path_s"] + r["left_s"] == pytest.approx(r["observed_s"])
    assert a["residual_p50_s"] == pytest.approx(0.030 + 0.002 - 0.011)
    assert a["path_fit_a_s"] == pytest.approx(a["residual_p50_s"]) and a["path_fit_b_s_per_token"] == 0.0
    assert a["median_signed_with_fit_pct"] == pytest.approx(0.0)
    assert b["path_s"] == pytest.approx(0.015) and b["left_s"] == pytest.approx(0.003)
    assert b["residual_p50_s"] == pytest.approx(0.018) and b["with_path"] == 10
    assert b["mape_pct"] == pytest.approx(100 * 0.003 / 0.050)
