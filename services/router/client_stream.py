"""The answer's way back to one client inbox: every message stamped with the query's id and the
client's nonce, exactly one terminal message (done or error), kept in the terminals bucket and
sent again after a NATS reconnect (``TerminalResender``): an accepted query is never left
without its end."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import structlog

from bear.protocol.errors import ErrorCode
from bear.protocol.replies import Done, Error, Reply, encode_reply, error_event
from bear.protocol.subjects import Subjects

log = structlog.get_logger("bear.router")

RESEND_S = 3.0  # terminal messages sent this long before a reconnect are sent again after it
RESEND_MAX = 20_000
TERMINAL_STORE_TRIES = 40  # tries (0.25 s apart) to store a terminal record again after a reconnect


class ClientStream:
    """Messages to one client inbox; guarantees exactly one terminal message (done or error)."""

    def __init__(self, nc: Any, inbox: str, query_id: str, recent: deque[tuple[float, str, bytes]] | None = None,
                 nonce: str | None = None, terminals: str | None = None) -> None:
        self.nc = nc
        self.inbox = inbox
        self.query_id = query_id
        self.nonce = nonce  # the client's, echoed in every message (its library drops messages without it)
        self.finished = False
        self.recent = recent  # the router's recently sent terminal messages (resent after a reconnect)
        self.terminals = terminals  # KV bucket keeping the terminal message for a client that missed it

    def _stamp(self, msg: Reply) -> bytes:
        """``msg`` with the query's id and the client's nonce (echoed in every message), encoded."""
        msg.query_id = self.query_id
        if self.nonce is not None:
            msg.nonce = self.nonce
        return encode_reply(msg)

    async def send(self, msg: Reply) -> None:
        if self.finished:
            return
        try:
            await self.nc.publish(self.inbox, self._stamp(msg))
        except Exception as exc:  # NATS down: the client's own timeout makes the failure explicit
            log.warning("reply to client failed", query_id=self.query_id, error=str(exc))

    async def finish(self, msg: Done | Error) -> None:
        if self.finished:
            return
        data = self._stamp(msg)
        try:
            await self.nc.publish(self.inbox, data)
        except Exception as exc:
            log.warning("reply to client failed", query_id=self.query_id, error=str(exc))
        if self.terminals:
            # kept in JetStream too (a plain publish: stored without an ack round trip, buffered
            # through a reconnect): a reply published while NATS restarts reaches the new server
            # before the client has subscribed again, and is lost — the client then reads it here
            try:
                await self.nc.publish(f"$KV.{self.terminals}.{Subjects.terminal_key(self.inbox)}", data)
            except Exception as exc:
                log.warning("terminal record failed", query_id=self.query_id, error=str(exc))
        self.finished = True
        if self.recent is not None:
            now = time.monotonic()
            self.recent.append((now, self.inbox, data))
            while self.recent and (now - self.recent[0][0] > RESEND_S or len(self.recent) > RESEND_MAX):
                self.recent.popleft()

    async def error(self, code: ErrorCode, message: str, **extra: Any) -> None:
        await self.finish(error_event(code, message, **extra))


class TerminalResender:
    """A NATS node that dies takes the messages in its buffers with it: the terminal messages of
    the last ``RESEND_S`` (``recent``, appended by every ``ClientStream.finish``) go out again
    after a reconnect, and are stored in the terminals bucket again until JetStream acknowledges."""

    def __init__(self, nc: Any, terminals_bucket: str) -> None:
        self.nc = nc
        self.bucket = terminals_bucket
        self.recent: deque[tuple[float, str, bytes]] = deque()

    async def run(self) -> None:
        """Watch the connection's reconnect count (until cancelled)."""
        seen = int(self.nc.stats.get("reconnects", 0))
        while True:
            await asyncio.sleep(0.05)
            now_seen = int(self.nc.stats.get("reconnects", 0))
            if now_seen == seen:
                continue
            seen = now_seen
            recent = list(self.recent)
            for _, inbox, data in recent:
                with contextlib.suppress(Exception):
                    await self.nc.publish(inbox, data)
            log.info("reconnected: terminal messages sent again", count=len(recent))
            if recent:  # inline: a reconnect during it is seen by the count when it returns
                await self.store(recent)

    async def store(self, recent: list[tuple[float, str, bytes]]) -> None:
        """Store the recent terminal records again, each until JetStream acknowledges it: the plain
        publish of a record that went out while NATS restarted can reach the new server before its
        JetStream has loaded the bucket, and is then dropped — the client that missed its ``done``
        then found no record either (1–3 of 480 queries in 20 restarts)."""
        for _, inbox, data in recent:
            subject = f"$KV.{self.bucket}.{Subjects.terminal_key(inbox)}"
            for _attempt in range(TERMINAL_STORE_TRIES):
                try:
                    ack = await self.nc.request(subject, data, timeout=0.5)
                    if b'"error"' not in ack.data:
                        break
                except Exception:  # not connected yet, or JetStream not ready: try again
                    pass
                await asyncio.sleep(0.25)
            else:
                log.warning("terminal record not stored after a reconnect", inbox=inbox[:64])
