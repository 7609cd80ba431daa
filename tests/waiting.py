"""Waiting on the event a test stands for, never on the clock (issue 23): a condition polled until
it holds, with a deadline that only bounds a hang — on a slow host the wait is longer, never
wrong. The one place in the tests where a poll interval lives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.02  # how often a condition is looked at: short against any event a test waits for
HANG_S = 60.0  # the default deadline: a test that waits this long is hung, not slow


class WaitTimeout(AssertionError):
    """The awaited event did not happen before the deadline (a hang, reported as a failure)."""


async def wait_until(cond: Callable[[], T | Awaitable[T]], *, timeout: float = HANG_S, what: str = "",  # noqa: ASYNC109
                     poll: float = POLL_S) -> T:
    """Return ``cond()``'s first truthy value (``cond`` may be a coroutine function); raise
    :class:`WaitTimeout` naming ``what`` when it stays falsy for ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if asyncio.iscoroutine(v) or isinstance(v, asyncio.Future):
            v = await v
        if v:
            return v  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what or cond!r}")
        await asyncio.sleep(poll)


def wait_until_sync(cond: Callable[[], T], *, timeout: float = HANG_S, what: str = "", poll: float = POLL_S) -> T:
    """:func:`wait_until` for code outside an event loop (threads, subprocess tests)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what or cond!r}")
        time.sleep(poll)
