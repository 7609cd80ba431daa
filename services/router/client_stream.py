"""The answer's way back to one client inbox: every message stamped with the query's id and the
client's nonce, exactly one terminal message (done or error), kept in the terminals bucket and
sent again after a NATS reconnect (``TerminalResender``): an accepted query is never left
without its end.

The chunks themselves are kept too (``AnswerKeeper``, bounded: ``KEEP_ANSWER_BYTES`` per answer,
``KEEP_BYTES`` in all, ``KEEP_S`` after the terminal message): chunks published while NATS
restarts are lost like a terminal message is, and the client library, which sees the gap in
``Chunk.seq`` (or, at the end, against ``Done.chunks``), asks for them on ``bear.cancel`` with a
``bear.resend/1``; the router keeping them publishes them to the inbox again (issue 40)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from functools import cache
from typing import Any

import structlog

from bear.protocol.errors import ErrorCode
from bear.protocol.replies import Chunk, Done, Error, Reply, encode_reply, error_event
from bear.protocol.subjects import Subjects
from bear.protocol.submit import Resend, decode_resend

log = structlog.get_logger("bear.router")

RESEND_S = 3.0  # terminal messages sent this long before a reconnect are sent again after it
RESEND_MAX = 20_000
TERMINAL_STORE_TRIES = 40  # tries (0.25 s apart) to store a terminal record again after a reconnect
KEEP_S = 30.0  # an answer's chunks are kept this long after its terminal message
KEEP_BYTES = 64 << 20  # the chunks kept of all answers together (the oldest answer's go first)
KEEP_ANSWER_BYTES = 4 << 20  # one answer's (its oldest chunks go first)
RESENDS_PER_ANSWER = 16  # bear.resend/1 requests served per answer


@cache
def resend_metrics() -> Any:
    """One set per process (prometheus_client's default registry)."""
    from types import SimpleNamespace

    from prometheus_client import Counter

    return SimpleNamespace(
        requests=Counter("bear_router_resend_requests_total",
                         "bear.resend/1 requests by outcome: served (chunks sent again), unknown (not an "
                         "answer kept here), refused (inbox or nonce not the answer's; over the per-answer limit)",
                         ["outcome"]),
        chunks=Counter("bear_router_chunks_resent_total", "Chunks sent again on a client's bear.resend/1"),
        not_kept=Counter("bear_router_chunks_not_kept_total",
                         "Chunks asked for that were no longer kept (past the bounds): that answer ends incomplete"),
    )


class _Kept:
    """One answer's chunks, ``first`` the seq of ``chunks[0]``; ``last``: when it last changed."""

    __slots__ = ("bytes", "chunks", "first", "last", "nonce", "query_id", "resends")

    def __init__(self, query_id: str, nonce: str | None, now: float) -> None:
        self.query_id = query_id
        self.nonce = nonce
        self.chunks: deque[bytes] = deque()
        self.first = 0
        self.bytes = 0
        self.last = now
        self.resends = 0


def _merged(ranges: list[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    """``[first, end)`` ranges cut at ``end``, sorted, overlaps merged (empty ones dropped)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((a, min(b, end)) for a, b in ranges if a < min(b, end)):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class AnswerKeeper:
    """The chunks this router relayed, per answer (keyed by its inbox), for a client that missed
    some: bounded in bytes per answer (a window of the newest) and in all (the least recently
    active answer's go first), kept until ``keep_s`` after the answer's last chunk or terminal
    message. Fed by ``ClientStream.send``; ``hear`` serves a ``bear.resend/1``."""

    def __init__(self, nc: Any, *, keep_s: float = KEEP_S, max_bytes: int = KEEP_BYTES,
                 answer_bytes: int = KEEP_ANSWER_BYTES, resends: int = RESENDS_PER_ANSWER) -> None:
        self.nc = nc
        self.keep_s = keep_s
        self.max_bytes = max_bytes
        self.answer_bytes = answer_bytes
        self.resends = resends
        self.answers: OrderedDict[str, _Kept] = OrderedDict()  # inbox → its chunks, least recently active first
        self.total = 0
        self.stats = {"served": 0, "unknown": 0, "refused": 0, "chunks": 0, "not_kept": 0, "evicted": 0}
        self.m = resend_metrics()

    def keep(self, inbox: str, query_id: str, nonce: str | None, seq: int, data: bytes) -> None:
        """Chunk ``seq`` of the answer to ``inbox``, as published (``data``)."""
        now = time.monotonic()
        k = self.answers.get(inbox)
        if k is None:
            k = self.answers[inbox] = _Kept(query_id, nonce, now)
        else:
            self.answers.move_to_end(inbox)
            k.last = now
        if seq != k.first + len(k.chunks):  # numbered afresh (a new attempt): the old ones are void
            self.total -= k.bytes
            k.chunks.clear()
            k.first, k.bytes = seq, 0
        k.chunks.append(data)
        k.bytes += len(data)
        self.total += len(data)
        while k.bytes > self.answer_bytes and len(k.chunks) > 1:  # a window of the newest
            old = k.chunks.popleft()
            k.first += 1
            k.bytes -= len(old)
            self.total -= len(old)
        self._trim(now)

    def finished(self, inbox: str) -> None:
        """The answer to ``inbox`` has its terminal message: kept ``keep_s`` more."""
        k = self.answers.get(inbox)
        if k is not None:
            self.answers.move_to_end(inbox)
            k.last = time.monotonic()
            self._trim(k.last)

    def _trim(self, now: float) -> None:
        while self.answers:
            inbox, k = next(iter(self.answers.items()))
            if now - k.last <= self.keep_s and self.total <= self.max_bytes:
                break
            if now - k.last <= self.keep_s:
                self.stats["evicted"] += 1
            del self.answers[inbox]
            self.total -= k.bytes

    async def hear(self, data: bytes) -> int:
        """Serve a ``bear.resend/1`` (anything else on the subject: 0, nothing done): the chunks
        asked for that are kept, published to the answer's inbox again; how many."""
        r = decode_resend(data)
        if r is None:
            return 0
        return await self.resend(r)

    async def resend(self, r: Resend) -> int:
        self._trim(time.monotonic())
        k = self.answers.get(r.inbox)
        if k is None:  # another router's answer, or one no longer kept
            self._count("unknown")
            return 0
        if k.query_id != r.query_id or k.nonce != r.nonce or k.resends >= self.resends:
            self._count("refused")
            return 0
        k.resends += 1
        chunks = list(k.chunks)  # a snapshot: publishing yields to the loop
        end = k.first + len(chunks)
        sent = not_kept = 0
        for a, b in _merged(r.missing, end):  # each chunk at most once per request
            not_kept += max(0, min(b, k.first) - a)
            for seq in range(max(a, k.first), b):
                with contextlib.suppress(Exception):
                    await self.nc.publish(r.inbox, chunks[seq - k.first])
                    sent += 1
        self._count("served")
        self.stats["chunks"] += sent
        self.m.chunks.inc(sent)
        if not_kept:
            self.stats["not_kept"] += not_kept
            self.m.not_kept.inc(not_kept)
        log.info("chunks sent again", query_id=k.query_id, chunks=sent, not_kept=not_kept)
        return sent

    def _count(self, outcome: str) -> None:
        self.stats[outcome] += 1
        self.m.requests.labels(outcome=outcome).inc()


class ClientStream:
    """Messages to one client inbox; guarantees exactly one terminal message (done or error)."""

    def __init__(self, nc: Any, inbox: str, query_id: str, recent: deque[tuple[float, str, bytes]] | None = None,
                 nonce: str | None = None, terminals: str | None = None, keeper: AnswerKeeper | None = None) -> None:
        self.nc = nc
        self.inbox = inbox
        self.query_id = query_id
        self.nonce = nonce  # the client's, echoed in every message (its library drops messages without it)
        self.finished = False
        self.recent = recent  # the router's recently sent terminal messages (resent after a reconnect)
        self.terminals = terminals  # KV bucket keeping the terminal message for a client that missed it
        self.keeper = keeper  # keeps the chunks for a client that missed some (bear.resend/1)
        self.chunks = 0  # the answer's chunks sent (seq of the last + 1): Done.chunks

    def _stamp(self, msg: Reply) -> bytes:
        """``msg`` with the query's id and the client's nonce (echoed in every message), encoded."""
        stamped: Any = msg  # every reply type (Routed, Chunk, Done, Error) has both fields
        stamped.query_id = self.query_id
        if self.nonce is not None:
            stamped.nonce = self.nonce
        return encode_reply(msg)

    async def send(self, msg: Reply) -> None:
        if self.finished:
            return
        data = self._stamp(msg)
        if isinstance(msg, Chunk):
            self.chunks = msg.seq + 1
            if self.keeper is not None:  # before the publish: a resend request may come as it returns
                self.keeper.keep(self.inbox, self.query_id, self.nonce, msg.seq, data)
        try:
            await self.nc.publish(self.inbox, data)
        except Exception as exc:  # NATS down: the client asks for the chunk again, or its timeout ends it
            log.warning("reply to client failed", query_id=self.query_id, error=str(exc))

    async def finish(self, msg: Done | Error) -> None:
        if self.finished:
            return
        if isinstance(msg, Done):
            msg.chunks = self.chunks  # so that the client can tell a lost last chunk from the end
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
        if self.keeper is not None:
            self.keeper.finished(self.inbox)
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
