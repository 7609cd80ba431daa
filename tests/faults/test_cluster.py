"""A real distributed deployment on loopback: a 3-node NATS cluster (JetStream KV replicated 3
times, authorization on), the services spread round robin over the nodes, two routers on
different nodes; the node of one router is killed under load. Every accepted query still ends
in an answer from a router (0 lost), routing goes on, and no query id runs twice."""

from __future__ import annotations

import pytest

from bear.benchmarks.faults import node_kill

pytestmark = pytest.mark.slow


def test_killing_a_nats_node_under_load_loses_nothing(tmp_path) -> None:
    figs = node_kill(tmp_path, rate=8.0, duration=10.0, at=3.0, seed=7)
    # how many queries failed with the node and how long until the last failure (recovery_s)
    # depend on the host: reported, not judged
    print(figs)
    assert figs["sent"] == 80
    assert figs["lost"] == 0, figs  # every query got its terminal message from a router
    assert figs["done"] + sum(figs["coded_errors"].values()) == figs["sent"]
    # routing goes on: queries sent after the last failure are served
    assert figs["done_after_recovery"] > 0, figs
    assert figs["executed_twice"] == 0, figs  # the dedup bucket (R3) held
