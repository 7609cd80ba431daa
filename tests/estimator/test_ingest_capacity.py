"""``bear bench estimator``'s capacity figures from its measurements (the ingest table): a worker
whose NATS receive read 0 CPU ticks over a brief run (10-ms ticks; CI's brief bench saw it) has no
instance count to report, rather than a division by zero (CI 6 Dec 2026)."""

from __future__ import annotations

from bear.benchmarks.estimator_ingest import STEPS_PER_S, capacity


def _row(rx_full: float, rx_delta: float) -> dict:
    return {"estimate": {"median_us": 20.0}, "ingest_full": {"median_us": 50.0}, "ingest_delta": {"median_us": 8.0},
            "full_bytes_per_step": 30_000, "delta_bytes_per_step": 400,
            "nats": {"full": {"cpu_us_per_message": rx_full}, "delta": {"cpu_us_per_message": rx_delta}}}


def test_capacity_counts_instances_from_the_measured_ingest() -> None:
    c = capacity(_row(30.0, 10.0), instances=100)
    assert c["full"]["per_step_us"] == 80.0 and c["delta"]["per_step_us"] == 10.0  # full: receive + install
    assert c["delta"]["instances_at_30_steps_s"] == 1.0 / (STEPS_PER_S * 10e-6)
    assert c["full"]["instances_at_30_steps_s"] < c["delta"]["instances_at_30_steps_s"]


def test_an_ingest_below_the_clocks_resolution_has_no_instance_count() -> None:
    c = capacity(_row(0.0, 0.0), instances=100)
    assert c["delta"]["per_step_us"] == 0.0 and c["delta"]["instances_at_30_steps_s"] is None
    assert c["delta"]["estimates_per_s_at_100"] == 1.0 / 20e-6  # the whole core left for estimates
    assert c["full"]["instances_at_30_steps_s"] == 1.0 / (STEPS_PER_S * 50e-6)  # the install is still timed
