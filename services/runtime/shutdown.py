"""Stopping background tasks and NATS connections for sure, in bounded time.

A plain ``t.cancel(); await t`` can hang forever on Python 3.11: ``asyncio.wait_for`` swallows a
cancellation that arrives in the same loop turn as its inner operation completing (its
implementation was rewritten in 3.12), so a ``while True`` loop that calls ``wait_for`` may simply carry on.
``cancel_all`` re-cancels whatever is still running until a deadline, then gives up loudly rather
than blocking a shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

import structlog

log = structlog.get_logger("bear.tasks")


async def cancel_all(
    tasks: Iterable[asyncio.Task[object]], timeout_s: float = 5.0, retry_s: float = 0.1
) -> list[asyncio.Task[object]]:
    """Cancel ``tasks`` and wait until they are done, re-cancelling stragglers every ``retry_s``
    until ``timeout_s``. Their exceptions are retrieved (never raised); returns the tasks that
    still refused to stop (empty when all stopped)."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(retry_s, left))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved, so asyncio does not warn at garbage collection
    if pending:
        log.warning("tasks did not stop", tasks=sorted(t.get_name() for t in pending), timeout_s=timeout_s)
    return list(pending)


async def close_nats(nc: Any, timeout_s: float = 5.0) -> None:
    """Drain ``nc`` (subscribers finish what they hold, buffered publishes go out), but never
    longer than ``timeout_s``: nats-py's ``drain()`` swallows a cancellation and then flushes
    for up to 10 s, so it runs as its own task and the connection is closed if it overruns. Without
    a server (it went first, or goes during the drain — the whole stack stopping at once) there is
    nothing to drain: the connection is closed at once."""
    if nc.is_closed:
        return
    if nc.is_connected:
        drain = asyncio.ensure_future(nc.drain())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not drain.done() and loop.time() < deadline and not (nc.is_reconnecting or nc.is_closed):
            await asyncio.wait({drain}, timeout=min(0.1, max(0.0, deadline - loop.time())))
        if drain.done() and not drain.cancelled() and drain.exception() is None:
            return
        if not drain.done():
            drain.cancel()
            if loop.time() >= deadline:
                log.warning("nats drain overran; closing", timeout_s=timeout_s)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 2.0)
