"""Issue 40, item 5: slowloris on the gateway. Half-sent requests were held ≈ 76 s each (aiohttp's
keep-alive timeout was all that bounded them) and one client could open as many connections as
the open-file limit allowed, after which every real request failed. Now a connection whose request
headers do not arrive within the header timeout is answered 408 and closed, one address holds at
most ``max_conns_per_peer`` connections (the next is answered 429 and closed at once), the total
is capped below the open-file limit, and each is counted and logged (a line per kind per 10 s, not
per connection) — while other clients' requests are still served."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import nats
import pytest
import structlog

from bear.gateway import connections
from bear.gateway.server import Gateway, GatewayConfig
from bear.runtime.nats_server import free_port

from waiting import HANG_S, wait_until

ATTACKER = "127.0.0.2"  # another loopback address: another peer to the gateway (Linux routes 127/8 to lo)


@contextlib.asynccontextmanager
async def gateway(nats_url: str, **cfg: Any) -> AsyncIterator[Gateway]:
    nc = await nats.connect(nats_url)
    gw = Gateway(nc, GatewayConfig(port=free_port(), **cfg))
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()
        await nc.close()


async def _open(gw: Gateway, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(gw.cfg.host, gw.cfg.port, local_addr=(source, 0))


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the gateway sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), HANG_S)


def _sent(counter: Any) -> float:
    return counter._value.get()


async def test_half_sent_headers_are_closed_after_the_header_timeout(nats_server) -> None:
    async with gateway(nats_server.url, header_timeout_s=0.3) as gw:
        before = _sent(gw.m.header_timeouts)
        reader, writer = await _open(gw)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")  # and no more
        await writer.drain()
        answer = await _closed(reader)  # closed by the gateway, not by the test's deadline
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"request headers not received within 0.3 s" in answer
        assert _sent(gw.m.header_timeouts) == before + 1
        assert gw.guard is not None and gw.guard.timed_out == 1
        await wait_until(lambda: gw.guard.open == 0, what="the closed connection released")


async def test_a_whole_request_is_served_and_a_kept_alive_connection_is_timed_again(nats_server) -> None:
    """Headers in time: the request is answered and the connection kept; a next request that
    then stalls half-way is timed from its first byte and closed."""
    async with gateway(nats_server.url, header_timeout_s=0.3) as gw:
        reader, writer = await _open(gw)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), HANG_S)
        assert status.startswith(b"HTTP/1.1 200 "), status
        length = 0
        while (line := await asyncio.wait_for(reader.readline(), HANG_S)) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        writer.write(b"GET /health HTTP/1.1\r\nHo")
        await writer.drain()
        answer = await _closed(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert gw.guard is not None and gw.guard.timed_out == 1


async def test_the_per_peer_cap_refuses_the_next_connection_and_others_are_served(nats_server) -> None:
    cap = 5
    logs: list[dict[str, Any]] = []
    async with gateway(nats_server.url, max_conns_per_peer=cap, header_timeout_s=HANG_S) as gw:
        assert gw.guard is not None
        before = _sent(gw.m.conn_refused.labels(reason="peer_cap"))
        held = [await _open(gw, ATTACKER) for _ in range(cap)]
        for _, w in held:  # half a request each, as a slowloris sends
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            await w.drain()
        await wait_until(lambda: gw.guard.by_peer[ATTACKER] == cap, what="the attacker's connections open")
        with structlog.testing.capture_logs() as logs:
            refused = []
            for _ in range(3):
                r, w = await _open(gw, ATTACKER)
                refused.append(await _closed(r))
                w.close()
        assert all(a.startswith(b"HTTP/1.1 429 ") and b"too many connections" in a for a in refused), refused
        assert gw.guard.refused["peer_cap"] == 3
        assert _sent(gw.m.conn_refused.labels(reason="peer_cap")) == before + 3
        lines = [e for e in logs if e["event"] == "connections refused"]
        assert len(lines) == 1, logs  # one line for the burst (the next, if any, after LOG_EVERY_S)
        assert lines[0]["reason"] == "peer_cap" and lines[0]["top"] == {ATTACKER: 1}
        # another client is still served while the attacker sits at its cap
        async with aiohttp.ClientSession() as s:
            for _ in range(cap + 2):
                async with s.get(f"http://127.0.0.1:{gw.cfg.port}/health") as resp:
                    assert resp.status == 200
        assert gw.guard.by_peer[ATTACKER] == cap
        for _, w in held:
            w.close()
        await wait_until(lambda: gw.guard.open == 0, what="every connection released")
        # below the cap again: the attacker's address may connect
        r, w = await _open(gw, ATTACKER)
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await _closed(r)).startswith(b"HTTP/1.1 200 ")
        w.close()


async def test_the_total_cap_refuses_with_503(nats_server) -> None:
    async with gateway(nats_server.url, max_connections=3, max_conns_per_peer=0, header_timeout_s=HANG_S) as gw:
        assert gw.guard is not None
        held = [await _open(gw) for _ in range(3)]
        await wait_until(lambda: gw.guard.open == 3, what="three open")
        r, w = await _open(gw, ATTACKER)
        answer = await _closed(r)
        w.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        assert gw.guard.refused["total_cap"] == 1
        for _, w in held:
            w.close()


def test_the_default_total_leaves_descriptors_for_the_process() -> None:
    assert connections.default_total(1024) == 1024 - connections.RESERVED_FDS
    assert connections.default_total(100) == connections.MIN_TOTAL
    cfg = GatewayConfig()
    assert cfg.connection_limits().total == connections.default_total(connections.open_file_limit())
    assert GatewayConfig(max_connections=0).connection_limits().total == 0


def test_loopback_aliases_are_reachable() -> None:
    """The tests above stand for another client by another loopback source address."""
    with socket.socket() as s:
        try:
            s.bind((ATTACKER, 0))
        except OSError as exc:
            pytest.fail(f"cannot bind {ATTACKER} (needs Linux's 127/8 loopback): {exc}")


def test_one_address_gets_at_most_half_of_the_total() -> None:
    assert GatewayConfig(max_connections=100, max_conns_per_peer=512).connection_limits().per_peer == 50
    assert GatewayConfig(max_connections=0, max_conns_per_peer=512).connection_limits().per_peer == 512
    assert GatewayConfig(max_connections=100, max_conns_per_peer=0).connection_limits().per_peer == 0
