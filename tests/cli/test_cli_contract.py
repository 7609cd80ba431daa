"""The CLI contract for bad input and unreachable stacks (issue 12): every case below exits with
its documented code (docs/cli.md), prints exactly one ``error: …`` line naming the problem, no
traceback, within a bounded time, and leaves no process or temporary file behind (the ``bear``
fixture checks that after each test). None of them needs a running stack."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from bear.predictor.tasks import TASKS
from bear.router.policies import REGISTRY
from bear.stack import discovery

from bear_cli import assert_one_line_error

UNREACHABLE = "nats://127.0.0.1:1"  # nothing listens on port 1: connection refused


@pytest.mark.parametrize("args", [
    ("submit", "hi"),
    ("load", "--duration", "1"),
])
def test_no_stack_found(bear, args) -> None:
    assert_one_line_error(bear(*args), 3, "no BEAR stack found", "bear up", "--nats")


@pytest.mark.parametrize("args", [
    ("submit", "hi", "--nats", UNREACHABLE),
    ("load", "--duration", "1", "--nats", UNREACHABLE),
    ("up", "--nats", UNREACHABLE),
    ("router", "--nats", UNREACHABLE),
])
def test_unreachable_nats_fails_fast_in_one_line(bear, args) -> None:
    res = bear(*args)
    assert_one_line_error(res, 3, "cannot connect to NATS", UNREACHABLE, "connection refused")
    assert not (bear.cwd / ".bear-up").exists()  # bear up started nothing


def test_a_load_no_prompt_of_fits_is_one_line_before_anything_is_sent(bear) -> None:
    """Checked before the connection: the unreachable NATS is never tried (exit 1, not 3)."""
    assert_one_line_error(bear("load", "--duration", "1", "--context", "20", "--nats", UNREACHABLE), 1,
                          "fit a 20-token context", "--tasks")


def test_env_url_wins_over_the_state_file_and_flag_over_both(bear) -> None:
    os.environ["BEAR_STATE_DIR"] = str(bear.state_dir)
    try:
        discovery.write_state({"nats_url": "nats://127.0.0.1:2"}, bear.cwd)  # this (live) process's "stack"
    finally:
        del os.environ["BEAR_STATE_DIR"]
    assert_one_line_error(bear("submit", "hi"), 3, "nats://127.0.0.1:2")  # found from the state file
    assert_one_line_error(bear("submit", "hi", cwd=bear.cwd.parent), 3, "no BEAR stack found")  # not above it
    sub = bear.cwd / "a" / "b"
    sub.mkdir(parents=True)
    assert_one_line_error(bear("submit", "hi", cwd=sub), 3, "nats://127.0.0.1:2")  # found from below it
    assert_one_line_error(bear("submit", "hi", BEAR_NATS_URL="nats://127.0.0.1:3"), 3, "nats://127.0.0.1:3")
    assert_one_line_error(bear("submit", "hi", "--nats", UNREACHABLE, BEAR_NATS_URL="nats://127.0.0.1:3"), 3,
                          UNREACHABLE)
    # a second `bear up` in the same directory refuses, naming the running one
    line = assert_one_line_error(bear("up"), 1, "already running from this directory", str(os.getpid()))
    assert "nats://127.0.0.1:2" in line and not (bear.cwd / ".bear-up").exists()


def test_stale_state_file_is_ignored_and_removed(bear) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    os.environ["BEAR_STATE_DIR"] = str(bear.state_dir)
    try:
        path = discovery.write_state({"nats_url": "nats://127.0.0.1:2"}, bear.cwd)
        rec = path.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {int(dead.stdout)}')
        path.write_text(rec)
    finally:
        del os.environ["BEAR_STATE_DIR"]
    assert_one_line_error(bear("submit", "hi"), 3, "no BEAR stack found")
    assert not path.exists()


@pytest.mark.parametrize(("args", "words"), [
    (("load", "--rate", "0"), ["--rate", "> 0"]),
    (("load", "--rate", "-3"), ["--rate"]),
    (("load", "--duration", "-1"), ["--duration", "> 0"]),
    (("load", "--arrivals", "foo"), ["--arrivals", "foo", "poisson", "mmpp"]),
    (("load", "--tasks", "nonsense"), ["--tasks", "nonsense", *TASKS]),
    (("load", "--tasks", "alpaca,nonsense"), ["nonsense"]),
    (("load", "--max-tokens", "0"), ["--max-tokens"]),
    (("load", "--lambda", "-1"), ["--lambda"]),
    (("up", "--load-rate", "-1"), ["--load-rate"]),
    (("up", "--load-duration", "0"), ["--load-duration"]),
    (("up", "--policy", "nonsense"), ["--policy", "nonsense", *REGISTRY]),
    (("up", "--backend", "tpu"), ["--backend", "'sim'", "'vllm'"]),
    (("up", "--routers", "0"), ["--routers"]),
    (("up", "--estimator-workers", "0"), ["--estimator-workers"]),
    (("up", "--snapshot-max-age", "0"), ["--snapshot-max-age"]),
    (("load", "--context", "1"), ["--context"]),
    (("gateway", "--nats", UNREACHABLE, "--no-auth", "--allowed-origins", "https://x"),
     ["--allowed-origins", "JSON list"]),
    (("up", "--metrics-port", "70000"), ["--metrics-port"]),
    (("up", "--vllm-model", "."), ["need --backend vllm"]),
    (("up", "--backend", "vllm", "--vllm-python", "/nonexistent/python"), ["not an executable"]),
    (("up", "--backend", "vllm", "--vllm-python", "/bin/false"), ["cannot import vllm"]),
    (("router", "--policy", "nonsense"), ["--policy", "round-robin"]),
    (("router", "--param", "overflow=2"), ["--param", "overflow must be 0"]),
    (("router", "--param", "overflow"), ["--param", "NAME=VALUE"]),
    (("up", "--param", "overflow=2"), ["--param", "overflow must be 0"]),
    (("up", "--policy", "score", "--param", "delta=1"), ["--param", "score", "delta"]),
    (("submit",), ["prompt", "--file", "stdin"]),
    (("submit", "hi", "--file", "p.txt"), ["--file"]),
    (("submit", "--file", "missing.txt"), ["--file", "cannot read", "missing.txt"]),
    (("submit", "   "), ["empty"]),
    (("submit", "hi", "--ttft-ms", "0"), ["--ttft-ms", "> 0"]),
    (("submit", "hi", "--max-tokens", "0"), ["--max-tokens"]),
    (("submit", "hi", "--bogus"), ["--bogus"]),
    (("nonsense-command",), ["nonsense-command"]),
    (("eval", "--experiment", "nonsense"), ["nonsense", "rates", "bursty"]),
    (("eval", "--policies", "bear,nonsense"), ["--policies", "nonsense", "round-robin"]),
    (("eval", "--rates", "abc"), ["--rates"]),
    (("eval", "--rates", "5,0"), ["--rates", "> 0"]),
    (("bench", "router", "--rate", "0"), ["--rate"]),
    (("bench", "pool", "--sizes", "1000,lots"), ["--sizes", "comma-separated"]),
    (("bench", "pool", "--sizes", "8"), ["--sizes", "16 blocks"]),
])
def test_bad_values_are_usage_errors_before_anything_starts(bear, args, words) -> None:
    (bear.cwd / "p.txt").write_text("a prompt")
    line = assert_one_line_error(bear(*args), 2, *words)
    assert "--help" in line  # where to look
    assert not (bear.cwd / ".bear-up").exists()


def test_empty_stdin_prompt(bear) -> None:
    assert_one_line_error(bear("submit", "-", stdin=""), 2, "empty")


def test_metrics_port_in_use_is_one_line_before_anything_starts(bear) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = assert_one_line_error(bear("up", "--metrics-port", str(port)), 1, str(port), "--metrics-port",
                                     "already in use")
    assert "0 to turn it off" in line
    runs = list((bear.cwd / ".bear-up" / "runs").glob("*")) if (bear.cwd / ".bear-up").exists() else []
    assert runs == []  # no run directory: nothing started


def test_debug_shows_the_traceback_and_still_ends_in_the_line(bear) -> None:
    res = bear("--debug", "submit", "hi", "--nats", UNREACHABLE)
    assert res.rc == 3 and "Traceback" in res.err
    assert res.err_lines[-1].startswith("error: cannot connect to NATS")
    res = bear("submit", "hi", "--nats", UNREACHABLE, BEAR_DEBUG="1")
    assert res.rc == 3 and "Traceback" in res.err


def test_help_lists_the_valid_values(bear) -> None:
    out = " ".join(bear("load", "--help").out.split())
    assert all(t in out for t in TASKS) and "poisson" in out and "mmpp" in out and "BEAR_NATS_URL" in out
    out = " ".join(bear("up", "--help").out.split())
    assert "round-robin" in out and "sim" in out and "vllm" in out and "--metrics-host" in out
    assert bear().rc == 0  # `bear` alone: the help, not an error


def test_the_error_line_does_not_show_a_password(bear) -> None:
    line = assert_one_line_error(bear("submit", "hi", "--nats", "nats://router:s3cret@127.0.0.1:1"), 3,
                                 "cannot connect to NATS", "router:***@127.0.0.1:1")
    assert "s3cret" not in line
