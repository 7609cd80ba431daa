"""Test helpers (tests/cli, tests/stack): running ``bear`` as a user does — a separate process,
through ``bear.cli.main`` — and checking the CLI contract of a failure: its exit code, exactly one
line ``error: …`` on stderr naming the problem, no traceback, an end (the run's timeout bounds a
hang; how long it took is printed), and nothing left behind (no process that inherited the
command's environment, nothing in its TMPDIR)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from waiting import WaitTimeout, wait_until_sync


@dataclass
class Result:
    rc: int
    out: str
    err: str
    seconds: float

    @property
    def err_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.strip()]


def processes_with(marker: str) -> list[int]:
    """Pids of this user's processes whose environment holds ``marker`` (children of a command
    inherit its environment, so an orphan left behind still carries it)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if marker.encode() in (d / "environ").read_bytes():
                found.append(int(d.name))
        except OSError:
            continue
    return found


@dataclass
class Bear:
    """``bear`` in a sandbox: its own state directory (no real stack is found), TMPDIR and cwd."""

    root: Path
    marker: str

    @property
    def cwd(self) -> Path:
        return self.root / "cwd"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("BEAR_NATS_URL", "BEAR_DEBUG")}
        env.update(BEAR_STATE_DIR=str(self.state_dir), TMPDIR=str(self.tmp), BEAR_TEST_MARKER=self.marker,
                   COLUMNS="200", TERM="dumb", PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def __call__(self, *args: str, timeout: float = 60.0, stdin: str | None = None, cwd: Path | None = None,
                 **env: str) -> Result:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "bear", *args], cwd=cwd or self.cwd, env=self.env(**env),
                           input=stdin, capture_output=True, text=True, timeout=timeout)
        return Result(p.returncode, p.stdout, p.stderr, time.monotonic() - t0)

    def assert_clean(self) -> None:
        try:  # processes that are ending (a child's SIGTERM from its parent) get the time they take
            wait_until_sync(lambda: not processes_with(self.marker), what="the command's processes to end")
        except WaitTimeout:
            raise AssertionError(f"processes left behind: {processes_with(self.marker)}") from None
        assert list(self.tmp.iterdir()) == [], f"left in TMPDIR: {list(self.tmp.iterdir())}"


def assert_one_line_error(res: Result, rc: int, *words: str, only: bool = True) -> str:
    """The contract of an expected failure; returns the line. ``only``: stderr holds nothing else
    (else: lines before it are allowed, e.g. ``bear submit``'s "→ instance" line). The run ended
    (``Bear.__call__``'s timeout bounds a hang); its time is printed, not asserted."""
    both = res.out + res.err
    assert "Traceback" not in both, both
    assert res.rc == rc, (res.rc, both)
    errors = [ln for ln in res.err_lines if ln.startswith("error:")]
    assert len(errors) == 1 and res.err_lines[-1] == errors[0], res.err
    assert not only or len(res.err_lines) == 1, res.err
    line = res.err_lines[-1]
    assert line.startswith("error: "), line
    for w in words:
        assert w in line, (w, line)
    print(f"{line[:80]!r} after {res.seconds:.1f} s")
    return line


def make_bear(root: Path) -> Bear:
    b = Bear(root, f"bear-cli-test-{uuid.uuid4().hex}")
    for d in (b.cwd, b.state_dir, b.tmp):
        d.mkdir()
    return b


def wait_for(pred: Callable[[], object], timeout_s: float, what: str, proc: subprocess.Popen[str] | None = None,
             log: Path | None = None) -> object:
    """``pred()``'s first truthy value; fails as soon as ``proc`` exits first, or after ``timeout_s``
    (a hang), with the end of ``log``."""

    def tail() -> str:
        return log.read_text()[-3000:] if log else ""

    def cond() -> object:
        got = pred()
        if not got and proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}: {tail()}")
        return got

    try:
        return wait_until_sync(cond, timeout=timeout_s, what=what)
    except WaitTimeout:
        raise AssertionError(f"not {what} after {timeout_s} s: {tail()}") from None


@dataclass
class UpProcess:
    """A ``bear up`` running in a sandbox, as a user starts it in a terminal."""

    bear: Bear
    proc: subprocess.Popen[str]
    log: Path

    last: dict | None = None  # the state as last read

    def state(self) -> dict:
        """The stack's published state ({} once it is gone)."""
        import json

        files = list(self.bear.state_dir.glob("up-*.json"))
        self.last = json.loads(files[0].read_text()) if files else {}
        return self.last

    def state_or_last(self) -> dict:
        return self.state() or self.last or {}

    def pids(self) -> list[int]:
        return [self.proc.pid, *self.state().get("pids", {}).values()]


def start_up(b: Bear, *args: str, timeout_s: float = 240.0,
             preexec_fn: Callable[[], object] | None = None) -> UpProcess:
    """Start ``bear up ARGS`` in ``b``'s directory; return once it has published its state file.
    ``preexec_fn``: run in the child before ``exec`` (e.g. to ignore SIGINT as a script's
    background job has it)."""
    log = b.root / "up.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "bear", "up", *args], cwd=b.cwd, env=b.env(), stdout=f,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=preexec_fn)
    up = UpProcess(b, proc, log)
    wait_for(lambda: up.state().get("pids"), timeout_s, "up", proc, log)
    return up


def all_gone(pids: list[int]) -> bool:
    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    return not any(alive(p) for p in pids)
