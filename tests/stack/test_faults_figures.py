"""``bear bench faults``' first-token figures (issue 26): the client's wait for a first token
before a fault and in the 10 s after it, and when the p99 is back within 2× of before — a NATS
restart used to report "recovery 0.0 s" (no query failed) while its first tokens waited seconds."""

from __future__ import annotations

import math

from bear.benchmarks.faults import FaultRun, Sent, faults_table, first_token_figures


def _q(t: float, first: float | None, status: str = "done") -> Sent:
    return Sent(f"q{t}", t, status=status, first_s=first)


def test_slow_first_tokens_after_a_fault_are_reported_and_their_recovery_timed() -> None:
    qs = [_q(t / 4, 0.1) for t in range(12)]  # 0 … 2.75 s: 100 ms
    qs += [_q(3.0 + t / 4, 5.0) for t in range(8)]  # 3 … 4.75 s: 5 s (the broker away)
    qs += [_q(5.0 + t / 4, 0.15) for t in range(20)]  # 5 … 9.75 s: back
    figs = first_token_figures(qs, t_fault=3.0)
    assert figs["first_token_before_ms"] == {"p50": 100.0, "p99": 100.0, "n": 12}
    assert figs["first_token_after_ms"]["p99"] == 5000.0 and figs["first_token_after_ms"]["n"] == 28
    assert figs["first_token_p99_recovery_s"] == 2.0  # the first window of submissions from 5.0 s on
    run = FaultRun("nats-restart", 3.0, qs)
    f = run.figures()
    assert f["recovery_s"] == 0.0  # no query failed: the old figure saw nothing
    assert f["first_token_p99_recovery_s"] == 2.0
    assert "| 100 / 100 ms | 150 / 5000 ms | 2.0 s |" in faults_table([f])


def test_a_query_without_a_first_token_is_infinitely_slow() -> None:
    qs = [_q(0.0, 0.1), _q(1.0, 0.1), _q(2.0, None, "deadline_exceeded"), _q(3.0, 0.1)]
    figs = first_token_figures(qs, t_fault=1.5)
    assert math.isinf(figs["first_token_after_ms"]["p99"])
    assert figs["first_token_p99_recovery_s"] == 1.0  # the windows from 2.5 s on: after the failed one
    assert first_token_figures(qs, None) == {}


def test_a_query_waiting_across_the_fault_counts_after_it() -> None:
    qs = [_q(0.0, 0.1), _q(1.0, 0.1), _q(1.4, 3.0), _q(2.0, 0.1), _q(4.0, 0.1)]
    figs = first_token_figures(qs, t_fault=1.5)
    assert figs["first_token_before_ms"]["n"] == 2  # served before the fault
    assert figs["first_token_after_ms"] == {"p50": 100.0, "p99": 3000.0, "n": 3}
    assert figs["first_token_p99_recovery_s"] == 0.5  # the first window (from before the fault) is slow
