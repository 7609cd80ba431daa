"""``bear up`` owns its children (issue 12): SIGTERM or SIGHUP under load stops every child (how
long it took is printed, not judged: a loaded host is slower), removes the temporary JetStream store and the published state and exits 128 + signal;
SIGKILL of ``bear up`` itself still takes every child with it (parent-death signal), and the stale
state is ignored; a child that dies during start-up fails ``bear up`` in one line that names it and
quotes its error."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from bear.stack.stack import Stack, StackConfig, StackError

from bear_cli import all_gone, assert_one_line_error, make_bear, start_up, wait_for
from waiting import HANG_S, WaitTimeout, wait_until_sync

# `bear up` with its default ports (the gateway's 8000): one such module at a time (docs/testing.md)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("bear_up_ports")]


def outcome_count(up) -> int:
    path = Path(up.state()["outcome_logs"][0])
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_under_load_stops_everything(tmp_path, sig) -> None:
    b = make_bear(tmp_path)
    up = start_up(b, "--load-rate", "6", "--load-duration", "120", "--metrics-port", "0")
    run_dir = Path(up.state()["run_dir"])
    assert (run_dir / "jetstream").is_dir()
    pids = up.pids()
    wait_for(lambda: outcome_count(up) >= 10, 60, "under load", up.proc, up.log)
    t0 = time.monotonic()
    up.proc.send_signal(sig)
    wait_for(lambda: all_gone(pids), HANG_S, "all gone", log=up.log)
    took = time.monotonic() - t0
    assert up.proc.wait(HANG_S) == 128 + sig, up.log.read_text()[-2000:]
    print(f"{signal.Signals(sig).name} under load: every process gone {took:.1f} s after the signal")  # with -s
    assert not (run_dir / "jetstream").exists()
    assert not list(b.state_dir.glob("up-*.json"))
    assert "Traceback" not in up.log.read_text()
    b.assert_clean()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a non-interactive shell's `bear up &` inherits


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_stops_a_background_job_with_sigint_ignored(tmp_path, sig) -> None:
    """Issue 26: ``bear up &`` from a script (SIGINT ignored, as such a job inherits it) ignored
    SIGTERM and SIGHUP — its handler re-raised SIGINT — and only SIGKILL stopped it. Issue 40: and
    SIGINT itself (9 of 9 processes alive 46 s after it); every ``bear`` process now puts an
    inherited ignored SIGINT back to the default at start (bear.runtime.process)."""
    b = make_bear(tmp_path)
    up = start_up(b, "--metrics-port", "0", preexec_fn=_ignore_sigint)
    pids = up.pids()
    t0 = time.monotonic()
    up.proc.send_signal(sig)
    wait_for(lambda: all_gone(pids), HANG_S, f"every process gone after {signal.Signals(sig).name}", log=up.log)
    print(f"{signal.Signals(sig).name}, SIGINT ignored: every process gone {time.monotonic() - t0:.1f} s after it")
    assert up.proc.wait(HANG_S) == 0, up.log.read_text()[-2000:]  # serving: a signal is the ordinary stop
    assert "stopped." in up.log.read_text()
    assert not list(b.state_dir.glob("up-*.json"))
    b.assert_clean()


def test_sigkill_of_bear_up_takes_its_children(tmp_path) -> None:
    b = make_bear(tmp_path)
    up = start_up(b, "--metrics-port", "0")
    named = up.state()["pids"]
    pids = up.pids()
    t0 = time.monotonic()
    up.proc.send_signal(signal.SIGKILL)
    try:  # each child stops on its own (SIGTERM from the kernel), NATS gone too
        wait_until_sync(lambda: all_gone(pids), what="every child gone")
        print(f"SIGKILL: every child gone {time.monotonic() - t0:.1f} s after it")  # with -s
    except WaitTimeout:
        pass  # named below, with their logs
    left = sorted(n for n, p in named.items() if not all_gone([p]))
    assert left == [], {n: (Path(up.state_or_last()["logs"]) / f"{n}.log").read_text()[-1500:] for n in left}
    up.proc.wait(5)
    # the state file is stale now: nothing finds a stack, and it is removed
    assert_one_line_error(b("submit", "hi"), 3, "no BEAR stack found")
    assert not list(b.state_dir.glob("up-*.json"))
    b.assert_clean()


def test_child_dying_at_start_up_is_named_and_quoted(tmp_path) -> None:
    st = Stack(StackConfig(workdir=tmp_path / "w", router_args=["--param", "bogus"], log_level="warning"))
    with pytest.raises(StackError) as err:
        st.start()
    st.stop()
    msg = str(err.value)
    assert "router-0 exited with code 2" in msg and "--param expects NAME=VALUE with a number, got 'bogus'" in msg, msg
    assert str(st.log_dir / "router-0.log") in msg
    assert all(not c.alive() for c in st.children.values()) and not (st.run_dir / "jetstream").exists()
    assert json.dumps(msg)  # one line
    assert "\n" not in msg
