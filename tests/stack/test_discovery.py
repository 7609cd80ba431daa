"""Where a running ``bear up`` is (bear.stack.discovery) and its run directories: the state file
is per directory and found from below it, a stale one is ignored and removed, flag > env > file;
old runs are pruned but never a live one, and a killed run's JetStream store is removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bear.stack import discovery
from bear.stack.stack import Stack, StackConfig


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("BEAR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("BEAR_NATS_URL", raising=False)
    return tmp_path / "state"


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_state_file_round_trip_and_lookup(state_dir, tmp_path, monkeypatch) -> None:
    here = tmp_path / "project"
    (here / "sub").mkdir(parents=True)
    path = discovery.write_state({"nats_url": "nats://127.0.0.1:4999"}, here)
    assert path.parent == state_dir and oct(path.stat().st_mode & 0o777) == "0o600"
    rec = discovery.read_state(here)
    assert rec is not None and rec["pid"] == os.getpid() and rec["cwd"] == str(here.resolve())
    assert discovery.read_state(here / "sub")["nats_url"] == "nats://127.0.0.1:4999"
    assert discovery.read_state(here / "sub", parents=False) is None
    assert discovery.read_state(tmp_path) is None
    monkeypatch.chdir(here / "sub")
    assert discovery.find_nats_url() == "nats://127.0.0.1:4999"
    monkeypatch.setenv("BEAR_NATS_URL", "nats://env:1")
    assert discovery.find_nats_url() == "nats://env:1"
    assert discovery.find_nats_url("nats://flag:1") == "nats://flag:1"
    discovery.remove_state(here)
    assert not path.exists()


def test_stale_state_is_removed_and_remove_state_spares_others(state_dir, tmp_path) -> None:
    path = discovery.write_state({"nats_url": "nats://x:1"}, tmp_path)
    path.write_text(path.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {dead_pid()}'))
    discovery.remove_state(tmp_path)  # not ours: left alone
    assert path.exists()
    assert discovery.read_state(tmp_path) is None and not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    assert discovery.read_state(tmp_path) is None


def test_runs_are_pruned_but_never_a_live_one(tmp_path) -> None:
    runs = tmp_path / "w" / "runs"
    dead, live = dead_pid(), os.getpid()
    names = [f"20260101-00000{k}-{dead}-abc{k}" for k in range(4)] + [f"20250101-000000-{live}-beef"]
    for n in names:
        (runs / n / "jetstream").mkdir(parents=True)
    (runs / "not-a-run").mkdir()
    st = Stack(StackConfig(workdir=tmp_path / "w", runs_kept=2))
    st.run_dir.mkdir(parents=True)
    st._prune_runs()
    left = sorted(p.name for p in runs.iterdir())
    # kept: the two newest (this one and the newest dead one, its store removed), the live one, others
    assert left == sorted([names[3], names[4], st.run_dir.name, "not-a-run"])
    assert not (runs / names[3] / "jetstream").exists() and (runs / names[4] / "jetstream").exists()
    st._link_latest()
    assert (tmp_path / "w" / "latest").resolve() == st.run_dir.resolve()


def test_metrics_ports_default_to_9464_and_step_aside_when_taken() -> None:
    import contextlib
    import socket

    from bear.commands.stack import DEFAULT_METRICS_PORT, metrics_ports
    from bear.runtime.metrics import port_free

    assert metrics_ports(0, 1, "127.0.0.1") == 0 and metrics_ports(9999, 1, "127.0.0.1") == 9999  # as asked
    with contextlib.ExitStack() as held:
        if port_free(DEFAULT_METRICS_PORT):  # taken by this test, unless something already holds it
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", DEFAULT_METRICS_PORT))
            s.listen()
        base = metrics_ports(None, 3, "127.0.0.1")  # a second stack on this machine: runs beside
        assert base != DEFAULT_METRICS_PORT and all(port_free(base + i) for i in range(3))
