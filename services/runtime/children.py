"""Child processes that cannot outlive the process that started them.

Each child gets its own session (so a Ctrl-C in the terminal reaches only the parent, which then
stops its children in order, and the parent can signal a child's whole process group) and, on
Linux, a parent-death signal: ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` in the child before ``exec``, so
a parent killed with SIGKILL or crashing still takes its children with it. The kernel sends that
signal when the *thread* that forked the child exits, so it is set only for children started from
the main thread (a worker thread may exit long before the process does)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return libc.prctl  # type: ignore[no-any-return]


_PRCTL = _prctl()  # resolved in the parent: the child between fork and exec only calls it


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when this process dies (None where
    that cannot be arranged: not Linux, or not called from the main thread)."""
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    prctl, parent = _PRCTL, os.getpid()

    def setup() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: nobody would signal us
            os._exit(1)

    return setup


def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen`` in a new session, dying with this process (see the module doc)."""
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent(), **kwargs)
