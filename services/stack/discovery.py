"""Where the running ``bear up`` is: one small JSON file per user and directory, so that
``bear submit``, ``bear load`` and the services find the stack without a URL copied from its
banner.

The file lives in ``$BEAR_STATE_DIR``, else ``$XDG_RUNTIME_DIR/bear`` (per user, cleared at
logout), else ``~/.cache/bear/stacks``, and is named after the directory ``bear up`` ran in. A
reader looks for the current directory and then each parent, so a command run anywhere below the
stack's directory finds it. The file names the ``bear up`` process; a file whose process is gone is
stale and is removed by the next reader. The URL is resolved flag > ``BEAR_NATS_URL`` > this file
(``find_nats_url``, which bear.commands.options applies to every command's ``--nats``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from bear.protocol import schemas

SCHEMA = schemas.STACK
NATS_ENV = "BEAR_NATS_URL"


def state_dir() -> Path:
    if os.environ.get("BEAR_STATE_DIR"):
        return Path(os.environ["BEAR_STATE_DIR"])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "bear"
    return Path.home() / ".cache" / "bear" / "stacks"


def state_path(directory: Path | None = None) -> Path:
    """The state file of a stack started in ``directory`` (default: the current directory)."""
    d = (directory or Path.cwd()).resolve()
    return state_dir() / f"up-{hashlib.sha1(str(d).encode()).hexdigest()[:16]}.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process with our pid number: not ours
        return False
    return True


def write_state(info: dict[str, Any], directory: Path | None = None) -> Path:
    """Publish ``info`` (URLs, pids, paths) as this process's stack for ``directory``."""
    path = state_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    rec = {"v": SCHEMA, "pid": os.getpid(), "cwd": str((directory or Path.cwd()).resolve()), **info}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec, indent=2))
    tmp.chmod(0o600)
    tmp.replace(path)  # atomic: a reader sees the old file or the new one
    return path


def read_state(directory: Path | None = None, *, parents: bool = True) -> dict[str, Any] | None:
    """The live stack of ``directory`` (or, with ``parents``, of its nearest parent that has one)."""
    d = (directory or Path.cwd()).resolve()
    for cand in [d, *d.parents] if parents else [d]:
        path = state_path(cand)
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict) or rec.get("v") != SCHEMA or not isinstance(rec.get("pid"), int):
            continue
        if not _alive(rec["pid"]):
            with contextlib.suppress(OSError):
                path.unlink()  # stale: its bear up is gone
            continue
        return rec
    return None


def remove_state(directory: Path | None = None) -> None:
    """Remove ``directory``'s state file if this process wrote it."""
    path = state_path(directory)
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def find_nats_url(flag: str | None = None) -> str | None:
    """The NATS URL a command uses: ``--nats``, else ``$BEAR_NATS_URL``, else the URL of the stack
    ``bear up`` runs for this directory (or a parent); None when there is none."""
    if flag:
        return flag
    if os.environ.get(NATS_ENV):
        return os.environ[NATS_ENV]
    rec = read_state()
    if rec is not None and isinstance(rec.get("nats_url"), str):
        return str(rec["nats_url"])
    return None

