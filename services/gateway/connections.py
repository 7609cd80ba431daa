"""The gateway's defence of its connections (issue 40: 1,000 half-sent requests were each held
≈ 76 s — aiohttp's keep-alive timeout was all that bounded them — and at a 1,024 open-file limit
1,100 of them made every real request fail for 40 s, with nothing logged).

* **Header timeout**: a request's line and headers must have arrived ``header_timeout_s`` after
  the connection opened (on a kept-alive connection: after the next request's first byte), else
  the connection is answered 408 and closed. The body has its own bound (``body_timeout_s``, in
  the handlers).
* **Per-peer cap**: at most ``per_peer`` connections open from one client address; the next is
  answered 429 at once and closed, before aiohttp sees it.
* **Total cap**: at most ``total`` connections open in all, so that the process keeps
  descriptors for NATS, its logs and the tokenizer fetches (default: the open-file limit less
  ``RESERVED_FDS``); beyond it a connection is answered 503 and closed.

Refusals and timeouts are counted (``bear_gateway_connections_refused_total{reason}``,
``bear_gateway_header_timeouts_total``; open connections: ``bear_gateway_connections``) and logged
one line per kind per ``LOG_EVERY_S``, naming the peers with the most and how many in all — never
a line per connection, which an attack would turn into a flood of its own."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp.web_protocol import RequestHandler

from bear.gateway.openai_wire import ApiError, dumps

log = structlog.get_logger("bear.gateway")

LOG_EVERY_S = 10.0  # at most one log line per kind of refusal in this long
RESERVED_FDS = 256  # descriptors kept from connections when the total cap comes from the open-file limit
MIN_TOTAL = 64


def _raw_response(status: int, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error object, written before aiohttp parses anything."""
    body = dumps(ApiError(status, message).body())
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
    return head.encode() + body


def default_total(nofile_soft: int) -> int:
    """The total cap the open-file soft limit leaves room for."""
    return max(MIN_TOTAL, nofile_soft - RESERVED_FDS)


def open_file_limit() -> int:
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return 1 << 20
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0  # 0: no header timeout
    per_peer: int = 512  # open connections per client address; 0: no cap
    total: int = 0  # open connections in all; 0: no cap (GatewayConfig: None → from the open-file limit)


class ConnectionGuard:
    """Open connections by peer, the caps and the header timeout of one listening gateway; its
    counts and rate-limited log lines (module doc)."""

    def __init__(self, limits: ConnectionLimits, metrics: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.limits = limits
        self.m = metrics
        self.loop = loop or asyncio.get_running_loop()
        self.open = 0
        self.by_peer: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # reason → connections refused (this guard's lifetime)
        self.timed_out = 0
        self._refused_c = {r: metrics.conn_refused.labels(reason=r) for r in ("peer_cap", "total_cap")}
        self._pending: dict[str, Counter[str]] = {}  # kind → peer → events not logged yet
        self._flush: asyncio.TimerHandle | None = None
        self._429 = _raw_response(429, f"too many connections from this address (at most "
                                  f"{limits.per_peer} open at once)", "Retry-After: 1\r\n")
        self._503 = _raw_response(503, f"the gateway holds its most connections "
                                  f"({limits.total}); try again", "Retry-After: 1\r\n")
        self.timeout_response = _raw_response(408, f"request headers not received within "
                                              f"{limits.header_timeout_s:g} s")

    def admit(self, peer: str) -> bytes | None:
        """None, the connection counted as open; or the response that refuses it (counted, logged)."""
        lim = self.limits
        if lim.per_peer and self.by_peer[peer] >= lim.per_peer:
            self._note_refused("peer_cap", peer)
            return self._429
        if lim.total and self.open >= lim.total:
            self._note_refused("total_cap", peer)
            return self._503
        self.open += 1
        self.by_peer[peer] += 1
        self.m.connections.inc()
        return None

    def release(self, peer: str) -> None:
        self.open -= 1
        n = self.by_peer[peer] - 1
        if n > 0:
            self.by_peer[peer] = n
        else:
            del self.by_peer[peer]
        self.m.connections.dec()

    def _note_refused(self, reason: str, peer: str) -> None:
        self.refused[reason] += 1
        self._refused_c[reason].inc()
        self._note(reason, peer)

    def note_timeout(self, peer: str) -> None:
        self.timed_out += 1
        self.m.header_timeouts.inc()
        self._note("header_timeout", peer)

    def _note(self, kind: str, peer: str) -> None:
        self._pending.setdefault(kind, Counter())[peer] += 1
        if self._flush is None:  # quiet until now: say so at once, then at most once per LOG_EVERY_S
            self._log()
            self._flush = self.loop.call_later(LOG_EVERY_S, self._tick)

    def _tick(self) -> None:
        self._flush = None
        if self._pending:
            self._log()
            self._flush = self.loop.call_later(LOG_EVERY_S, self._tick)

    def _log(self) -> None:
        pending, self._pending = self._pending, {}
        for kind, peers in pending.items():
            top = dict(peers.most_common(3))
            if kind == "header_timeout":
                log.warning("connections closed: request headers too slow", connections=sum(peers.values()),
                            peers=len(peers), top=top, header_timeout_s=self.limits.header_timeout_s,
                            within_s=LOG_EVERY_S)
            else:
                log.warning("connections refused", reason=kind, connections=sum(peers.values()), peers=len(peers),
                            top=top, per_peer=self.limits.per_peer, total=self.limits.total, open=self.open,
                            within_s=LOG_EVERY_S)

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._pending:
            self._log()


def _peer_of(transport: Any) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple | list) and peer:
        return str(peer[0])
    return str(peer or "")


class GuardedHandler(RequestHandler):
    """aiohttp's connection handler under a :class:`ConnectionGuard` (``manager.guard``; None:
    unguarded): a connection over a cap is answered and closed before aiohttp sees it; one whose
    request headers do not arrive in time is answered 408 and closed."""

    def __init__(self, manager: Any, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard: ConnectionGuard | None = getattr(manager, "guard", None)
        self._peer: str | None = None  # set once admitted
        self._refused = False
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        if guard is not None:
            peer = _peer_of(transport)
            refusal = guard.admit(peer)
            if refusal is not None:
                self._refused = True
                self._manager = None  # aiohttp's server never counts it: connection_lost has nothing to undo
                tr: Any = transport
                tr.write(refusal)
                tr.close()
                return
            self._peer = peer
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        guard = self._guard
        if guard is not None and guard.limits.header_timeout_s > 0 and self._header_timer is None:
            self._header_timer = self._loop.call_later(guard.limits.header_timeout_s, self._headers_late)

    def _idle(self) -> bool:
        """Waiting for a request's headers (aiohttp's own test, as its keep-alive timer's): not
        handling one, reading its body, writing its answer or draining what it left unread."""
        waiter = self._waiter
        return waiter is not None and not waiter.done() and not self._messages

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self._idle() or self._force_close or self.transport is None:
            return  # a request arrived and is being handled, or the connection is going anyway
        assert self._guard is not None and self._peer is not None
        self._guard.note_timeout(self._peer)
        self.transport.write(self._guard.timeout_response)
        self.force_close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._header_timer is None and self._idle():
            self._arm()  # the first byte of a next request on a kept-alive connection
        before = self._request_count
        super().data_received(data)
        if self._request_count != before and self._header_timer is not None:
            self._header_timer.cancel()  # its headers are in
            self._header_timer = None

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if self._peer is not None and self._guard is not None:
            self._guard.release(self._peer)
            self._peer = None
        super().connection_lost(exc)
