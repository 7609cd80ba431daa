"""The event loop every BEAR process runs on.

uvloop (libuv) when it is installed — it halves the loop's own cost per callback, which is most of
what a router at 200 queries/s spends between a reply arriving and the query resuming — else
asyncio's default loop. ``BEAR_EVENT_LOOP=asyncio`` forces the default (A/B measurements, or a
platform where uvloop misbehaves)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name() -> str:
    """``uvloop`` or ``asyncio``: what :func:`run` will use in this process."""
    if os.environ.get("BEAR_EVENT_LOOP", "uvloop").lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop chosen by :func:`loop_name`."""
    if loop_name() == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)
