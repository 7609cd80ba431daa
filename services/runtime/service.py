"""The harness every BEAR process runs in: one NATS connection whose *first* connection attempt is
bounded (a wrong URL is one clear error after a few seconds, not an endless retry loop printing
tracebacks) and which then reconnects as the caller asks, logging (never raising) asynchronous
errors; and a stop event set by SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
from pathlib import Path
from typing import Any

import structlog

from bear.protocol.errors import BearError, ErrorCode
from bear.runtime.identity import CREDS_ENV

log = structlog.get_logger("bear.runtime")

CONNECT_WITHIN_S = 5.0  # how long the first connection may take before it is an error
NO_STACK = "no BEAR stack found: start one with `bear up` or pass --nats"
_RETRY_WAIT_S = 0.25


def stop_event() -> asyncio.Event:
    """An event set on SIGINT or SIGTERM: a service's main awaits it, then shuts down in order."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


def auth_options(creds: str | Path | None = None) -> dict[str, Any]:
    """nats-py options that authenticate as the identity in ``creds`` (default:
    ``$BEAR_NATS_CREDS``; none: anonymous, for a server run with ``--insecure``)."""
    from bear.runtime.identity import creds_from_env, load_identity

    path = creds if creds is not None else creds_from_env()
    return load_identity(path).connect_options() if path else {}


async def connect(url: str, name: str, *, connect_within_s: float = CONNECT_WITHIN_S,
                  max_reconnect_attempts: int = -1, creds: str | Path | None = None, **options: Any) -> Any:
    """A NATS connection named ``name``, authenticated as the identity in ``creds`` (default
    ``$BEAR_NATS_CREDS``, which ``bear up`` sets for each child; ``--nats-creds`` sets it for a
    command). The first connection is tried for about ``connect_within_s`` and then raises
    ``BearError(UNAVAILABLE)`` naming the URL and the last failure (a refused identity:
    ``BearError(BAD_REQUEST)`` saying so); once connected it reconnects
    ``max_reconnect_attempts`` times (-1: forever). Slow-consumer drops, permission violations and
    other asynchronous errors are logged, not fatal. An empty ``url`` (a command's ``--nats``
    found no stack, bear.commands.options) is the error "no BEAR stack found"."""
    if not url:
        raise BearError(ErrorCode.UNAVAILABLE, NO_STACK)
    options = {**auth_options(creds), **options}
    import nats
    from nats.aio.client import Client
    from nats.errors import NoServersError

    last: list[BaseException] = []
    nc = Client()
    connected = False

    async def on_error(exc: Exception) -> None:
        if not connected:
            last.append(exc)  # the first connection is still being tried: reported once, below
            return
        log.warning("nats error", connection=name, error=str(exc) or type(exc).__name__)

    connect_timeout = min(2.0, max(0.2, connect_within_s / 2))
    # nats-py tries a server max_reconnect_attempts + 1 times on the first connect (forever if
    # negative): bound it (and the whole first connection, for hosts that drop packets), then give
    # the connection the reconnect policy the caller asked for
    attempts = max(1, math.ceil(connect_within_s / _RETRY_WAIT_S))
    wait = options.pop("reconnect_time_wait", 0.2)
    try:
        await asyncio.wait_for(nc.connect(servers(url), name=name, error_cb=on_error, connect_timeout=connect_timeout,
                                          max_reconnect_attempts=attempts, reconnect_time_wait=min(wait, _RETRY_WAIT_S),
                                          **options), connect_within_s + connect_timeout)
    except (NoServersError, OSError, TimeoutError, nats.errors.Error) as exc:
        with contextlib.suppress(Exception):
            await nc.close()
        why = last[-1] if last else exc
        if _auth_refused(why) or any(_auth_refused(e) for e in last):
            who = "the identity in " + str(creds or os.environ.get(CREDS_ENV, "")) if options.get("nkeys_seed_str") \
                else "a connection without credentials"
            raise BearError(ErrorCode.BAD_REQUEST, f"NATS at {_redacted(url)} refused {who} (authorization "
                                                   "violation): pass --nats-creds FILE, or run in the bear up "
                                                   "directory") from exc
        raise BearError(ErrorCode.UNAVAILABLE, f"cannot connect to NATS at {_redacted(url)}: {_describe(why)}") from exc
    except ValueError as exc:  # a malformed URL
        raise BearError(ErrorCode.BAD_REQUEST, f"invalid NATS URL {_redacted(url)!r}: {exc}") from exc
    connected = True
    nc.options["max_reconnect_attempts"] = max_reconnect_attempts
    nc.options["reconnect_time_wait"] = wait
    return nc


def servers(url: str) -> str | list[str]:
    """``url`` for nats-py: a comma-separated list of servers (a cluster) as a list."""
    return [u.strip() for u in url.split(",") if u.strip()] if "," in url else url


def _auth_refused(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "authorization violation" in text or "authentication" in text or "user authentication" in text


def _redacted(url: str) -> str:
    """``url`` without its password (deployments embed per-service credentials in the URL)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        if parts.password:
            return url.replace(f":{parts.password}@", ":***@", 1)
    except ValueError:
        pass
    return url


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__
