"""The harness every BEAR service process runs in: one NATS connection that reconnects forever
and logs (never raises) asynchronous errors, and a stop event set by SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

import structlog

log = structlog.get_logger("bear.runtime")


def stop_event() -> asyncio.Event:
    """An event set on SIGINT or SIGTERM: a service's main awaits it, then shuts down in order."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def connect(url: str, name: str, **options: Any) -> Any:
    """A NATS connection named ``name`` that reconnects forever; slow-consumer drops and other
    asynchronous errors are logged, not fatal."""
    import nats

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", connection=name, error=str(exc))

    options.setdefault("max_reconnect_attempts", -1)
    options.setdefault("reconnect_time_wait", 0.2)
    return await nats.connect(url, name=name, error_cb=on_error, **options)
