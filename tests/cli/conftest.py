"""Running ``bear`` as a user does — a separate process, through ``bear.cli.main`` — and checking
the CLI contract of a failure: its exit code, exactly one line ``error: …`` on stderr naming the
problem, no traceback, bounded time, and nothing left behind (no process that inherited the
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

import pytest


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
        deadline = time.monotonic() + 10.0
        while processes_with(self.marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_with(self.marker) == [], "processes left behind"
        assert list(self.tmp.iterdir()) == [], f"left in TMPDIR: {list(self.tmp.iterdir())}"


def assert_one_line_error(res: Result, rc: int, *words: str, within_s: float = 15.0) -> str:
    """The contract of an expected failure; returns the line."""
    both = res.out + res.err
    assert "Traceback" not in both, both
    assert res.rc == rc, (res.rc, both)
    assert len(res.err_lines) == 1, res.err
    line = res.err_lines[0]
    assert line.startswith("error: "), line
    for w in words:
        assert w in line, (w, line)
    assert res.seconds < within_s, res.seconds
    return line


@pytest.fixture
def bear(tmp_path: Path) -> Callable[..., Result]:
    b = Bear(tmp_path, f"bear-cli-test-{uuid.uuid4().hex}")
    for d in (b.cwd, b.state_dir, b.tmp):
        d.mkdir()
    yield b
    b.assert_clean()
