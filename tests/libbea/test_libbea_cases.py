"""Real vLLM behaviour: the public CPU traces replayed step by step, and TTFT with calibrated β."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from bear import libbea
from bear.calibrator.fit import fit_beta, read_records
from bear.replay.cases import replay_case


def test_batch_sequences_match_vllm(cases: list[dict]) -> None:
    assert len(cases) == 200
    results = [replay_case(c, [1.0, 0.0, 0.0, 0.0], trace=True) for c in cases]
    mismatched = [(c["trace"], c["request"]["id"]) for c, r in zip(cases, results, strict=True) if not r.exact]
    # The spec's §16 names one case (public-e) that no replay can know: a later arrival switches the
    # long-prefill threshold back on. Everything else must match step by step.
    assert len(mismatched) <= 1, mismatched
    assert all(t == "public-e" for t, _ in mismatched)
    # Preemption under KV pressure is exercised by the matching cases.
    assert sum(1 for c, r in zip(cases, results, strict=True) if c["preemption_in_horizon"] and r.exact) >= 40


def test_closed_form_stretches_equal_stepwise(cases: list[dict]) -> None:
    beta = [2.4e-3, 1.2e-5, 3.6e-7, 5.5e-9]
    for c in cases:
        s = libbea.Snapshot.from_dict(c["snapshot"])
        fast = libbea.estimate(s, c["request"], beta=beta, lengths=c["output_lengths"])
        slow = libbea.estimate(s, c["request"], beta=beta, lengths=c["output_lengths"], collapse=False)
        assert fast["n_batches"] == slow["n_batches"]
        assert abs(fast["ttft_s"] - slow["ttft_s"]) <= 1e-9 * max(1.0, slow["ttft_s"])


def test_ttft_mape_with_calibrated_beta(cases: list[dict], traces_dir, capsys) -> None:
    by_trace: dict[str, list[tuple[float, float]]] = defaultdict(list)
    report = {}
    for name, suffix in (("public-e", "e"), ("public-f", "f")):
        cal = fit_beta(read_records([traces_dir / f"batches_{suffix}.jsonl.gz"]))
        for c in cases:
            if c["trace"] == name:
                r = replay_case(c, cal.beta)
                by_trace[name].append((r.ttft_s, c["engine_ttft_s"]))
        pred, true = np.array(by_trace[name]).T
        mape = float(np.mean(np.abs(pred - true) / true))
        report[name] = (mape, cal.mape, len(pred))
        # The CPU build's batch times scatter 9-22% around their group median (§16); the replay
        # must stay within that band on TTFT.
        assert mape < 0.25, (name, mape)
    with capsys.disabled():
        for name, (mape, bmape, n) in report.items():
            print(f"\n[{name}] TTFT MAPE {mape * 100:.1f}% over {n} cases (batch-time MAPE {bmape * 100:.1f}%)")
