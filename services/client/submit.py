"""The client side of ``bear.submit``: ``submit()`` publishes one query with a reply inbox and
returns an async iterator over the router's messages, typed (``bear.protocol.replies``) —
``Routed`` (possibly again, with ``attempt`` 2, when the first instance did not answer),
``Chunk`` text pieces, then exactly one terminal ``Done`` or ``Error``.

No answer within ``accept_timeout_s`` (no router, or the submission was lost in a NATS restart)
→ the same ``query_id`` is resubmitted (routers deduplicate ids, so it never runs twice); still
nothing, or a stream silent for ``idle_timeout_s`` → a client-made ``bear.error/1`` (``client:
true``), so the caller always gets a terminal message.

A caller that stops before the router's terminal message (closes or cancels the iterator, or the
client gave up on a silent stream) publishes ``bear.cancel/1`` on ``<prefix>.cancel``, naming the
answer's inbox: the router serving the query aborts the engine's generation (docs/router.md).

Every submission carries its ``deadline``: when this client stops waiting for the query to start
(after the last resubmission's ``accept_timeout_s``). A router does not start a query after it —
the answer would go to nobody. A query larger than the NATS
server's ``max_payload`` is not sent: it gets a client-made ``too_large`` error at once.

A stream silent for ``recover_s`` (or a submission not yet answered) reads the router's terminal
record — then, while the connection has not reconnected since the submission, after twice that
silence, four times … (back to ``recover_s`` when a message comes; every ``recover_s`` once it
has reconnected, when a terminal message is most likely lost): an overloaded pool's queries wait
seconds for a first token, and a read a second each put load on NATS exactly then (``Subjects.terminals_bucket``, keyed by a hash of the answer's inbox): a ``done`` the
router published while NATS restarted reached the new server before this client had subscribed
again and was lost — the client used to wait ``idle_timeout_s`` and end in ``deadline_exceeded``
(issue 26). A terminal message taken from there is counted in ``RECOVERED``.

A submission goes to ``bear.submit.<identity>`` (the connection's inbox prefix names the
identity; anonymous connections use ``bear.submit``) and carries a random ``nonce`` that the
router echoes in every message of the stream: a message in the inbox without this query's id
and nonce is dropped and counted (``FOREIGN_DROPPED``), never yielded (issue 26).

An answer is whole or ends in a coded error, never ``done`` with a chunk missing (issue 40): the
chunks are yielded in ``seq`` order (``ChunkOrder``), a chunk that arrives early is held (up to
``MAX_HELD`` of them), and the ``done`` — whose ``chunks`` says how many there were — only after
all of them. A gap (chunks lost in a NATS restart) is asked for with a ``bear.resend/1`` on
``<prefix>.cancel`` (every router hears it; the one that relayed the answer keeps its chunks a
while and publishes them again), again every ``recover_s`` while it lasts; still open ``resume_s``
after the terminal message arrived with no chunk filling it, the answer ends in the client's
``incomplete`` error naming the chunks lost. ``RESUMED`` counts the answers made whole, the
chunks that filled gaps, the requests, and the answers given up."""

from __future__ import annotations

import asyncio
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import structlog
from msgspec import UNSET

from bear.protocol import schemas
from bear.protocol.errors import ErrorCode
from bear.protocol.messages import encode
from bear.protocol.replies import Chunk, Done, Error, Reply, decode_reply, error_event
from bear.protocol.subjects import Subjects
from bear.protocol.submit import MAX_RESEND_RANGES, TAKEOVER_PROBE_S, Cancel, Resend, Submit
from bear.protocol.token_ids import pack

log = structlog.get_logger("bear.client")

TERMINAL = schemas.TERMINAL
# Messages that reached a submission's inbox but are not of its query (another query id, or not
# the per-query nonce the router echoes): dropped, counted here, one warning line per submission.
FOREIGN_DROPPED = {"messages": 0}
# Terminal messages read from the routers' terminal records (their own message was lost), and reads.
RECOVERED = {"terminals": 0, "reads": 0}
RECOVER_S = 1.0  # the silence after which a submission reads its terminal record
# Answers with a gap in their chunks: made whole (``answers``), the chunks that filled a gap,
# the bear.resend/1 requests sent, and answers ended ``incomplete`` (the gap not filled).
RESUMED = {"answers": 0, "chunks": 0, "requests": 0, "incomplete": 0}
TAKEOVERS = {"asked": 0}  # takeover resubmissions sent (an accepted query's router silent: gone?)
RESUME_S = 5.0  # a gap still open this long after the terminal message (no chunk filling it): incomplete
MAX_HELD = 4096  # chunks held behind a gap; more: the answer ends incomplete at once


class ChunkOrder:
    """One answer's chunks in ``seq`` order: ``add`` returns those now due (the next expected and
    any held behind it), holds one that came early, drops one already given; ``end`` takes the
    terminal ``Done``'s chunk count. ``missing`` names the gap as ``[first, end)`` ranges."""

    def __init__(self, max_held: int | None = None) -> None:
        self.next = 0  # the seq due next
        self.held: dict[int, Chunk] = {}
        self.total: int | None = None  # Done.chunks, once known
        self.max_held = MAX_HELD if max_held is None else max_held
        self.top = 0  # past the highest seq seen (or the total): below it, a chunk fills a gap
        self.filled = 0  # chunks that came after a later one, or after the done (a gap they filled)
        self.gapped = False  # a gap was ever seen
        self.duplicates = 0

    def add(self, c: Chunk) -> list[Chunk]:
        seq = c.seq
        if seq < self.next or seq in self.held or (self.total is not None and seq >= self.total):
            self.duplicates += 1
            return []
        if seq < self.top:
            self.filled += 1
        self.top = max(self.top, seq + 1)
        if seq != self.next:
            self.held[seq] = c
            self.gapped = True
            return []
        out = [c]
        self.next += 1
        while self.next in self.held:
            out.append(self.held.pop(self.next))
            self.next += 1
        return out

    def end(self, total: int | None) -> None:
        """The terminal message says the answer had ``total`` chunks (None: it does not say)."""
        if total is not None:
            self.total = total
            self.top = max(self.top, total)
            for seq in [s for s in self.held if s >= total]:
                del self.held[seq]
            if self.next < total:
                self.gapped = True

    @property
    def whole(self) -> bool:
        """Every chunk up to the end given (with no count known: none held behind a gap)."""
        return not self.held and (self.total is None or self.next >= self.total)

    @property
    def overflow(self) -> bool:
        return len(self.held) > self.max_held

    def missing(self, limit: int = MAX_RESEND_RANGES) -> list[tuple[int, int]]:
        """The gap: ranges of seqs not received, below the highest held (or the total)."""
        top = self.total if self.total is not None else (max(self.held) if self.held else self.next)
        out: list[tuple[int, int]] = []
        a = self.next
        for seq in sorted(self.held):
            if seq > a:
                out.append((a, seq))
                if len(out) >= limit:
                    return out
            a = seq + 1
        if a < top:
            out.append((a, top))
        return out[:limit]

    def lost(self) -> int:
        """How many chunks are missing."""
        return sum(b - a for a, b in self.missing(limit=1 << 30))

    def describe(self) -> str:
        ranges = self.missing(limit=8)
        said = ", ".join(str(a) if b == a + 1 else f"{a}–{b - 1}" for a, b in ranges)
        more = len(self.missing(limit=9)) > 8
        of = f" of {self.total}" if self.total is not None else ""
        return (f"{self.lost()} chunk(s){of} lost in transit and not sent again (seq {said}{', …' if more else ''}); "
                f"{self.next} received in order")


def _reconnects(nc: Any) -> int:
    """How often ``nc`` reconnected (nats-py's stats; 0 for a connection without them)."""
    stats = getattr(nc, "stats", None)
    return int(stats.get("reconnects", 0)) if isinstance(stats, dict) else 0


async def terminal_record(nc: Any, subjects: Subjects, inbox: str, query_id: str, nonce: str,
                          timeout_s: float = 1.0) -> Done | Error | None:
    """The router's terminal message to ``inbox`` kept in JetStream (a direct get of one key);
    None when there is none (yet), NATS is away, or it is not this query's (id and nonce)."""
    b = subjects.terminals_bucket
    RECOVERED["reads"] += 1
    try:
        msg = await nc.request(f"$JS.API.DIRECT.GET.KV_{b}.$KV.{b}.{subjects.terminal_key(inbox)}", b"",
                               timeout=timeout_s)
    except Exception:  # not connected, no such bucket, not allowed: the stream's own timeout decides
        return None
    if not msg.data or (msg.headers or {}).get("Status"):
        return None
    d = decode_reply(msg.data)
    if d is None or d.query_id != query_id or d.nonce != nonce or not isinstance(d, Done | Error):
        return None
    return d


async def next_reply(queue: asyncio.Queue[Any], within_s: float) -> Any:
    """The next message of a submission's inbox, within ``within_s`` (``TimeoutError`` else).
    Read from a queue the subscription fills, never with nats-py's ``next_msg``: that takes the
    message off its queue in a task of its own, so a timeout that fired as a reply arrived lost
    the reply (a router's ``deadline_exceeded`` sent 1 s after dispatch, read just as the client's
    1 s recovery timer fired: the client waited out its whole idle timeout). A cancelled
    ``Queue.get`` leaves the message queued for the next read."""
    async with asyncio.timeout(within_s):
        return await queue.get()


def is_terminal(msg: Reply) -> bool:
    return msg.terminal


class Inboxes:
    """Reply inboxes for many submissions under one wildcard subscription (``<prefix>.<n>``), for
    a process that submits all the time (the gateway): no SUB/UNSUB round of protocol lines per
    query, and each reply reaches its waiter through one queue instead of nats-py's task per
    ``next_msg``."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._n = 0
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.prefix + ".*", cb=self._on_msg, pending_msgs_limit=1 << 20)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass

    async def _on_msg(self, msg: Any) -> None:
        q = self._queues.get(msg.subject)
        if q is not None:  # else: the submission is over (late or duplicate replies)
            q.put_nowait(msg)

    def open(self) -> tuple[str, asyncio.Queue[Any]]:
        self._n += 1
        inbox = f"{self.prefix}.{self._n}"
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[inbox] = q
        return inbox, q

    def close(self, inbox: str) -> None:
        self._queues.pop(inbox, None)


async def _ask_takeover(nc: Any, subject: str, req: Submit, inbox: str, headers: dict[str, str] | None,
                        held: int, accept_s: float) -> float:
    """Resubmit ``req`` as a takeover (``Submit.takeover``: the chunks held): a router whose owner
    is gone runs it (none held) or answers ``incomplete``; while the owner lives, ``duplicate``.
    Returns until when the client waits for the takeover to start (loop time)."""
    TAKEOVERS["asked"] += 1
    wait = accept_s + TAKEOVER_PROBE_S
    again = msgspec.structs.replace(req, takeover=held, deadline=time.time() + wait)
    try:
        await nc.publish(subject, encode(again), reply=inbox, headers=headers)
    except Exception:  # NATS away: asked again at the next silent read
        pass
    return asyncio.get_running_loop().time() + wait


async def submit(nc: Any, prompt: str | None = None, *, ttft_target_s: float = 1.0, max_tokens: int | None = 256,
                 lam: float | None = None, query_id: str | None = None, messages: list[dict[str, Any]] | None = None,
                 prompt_tokens: int | None = None,
                 subjects: Subjects | None = None, accept_timeout_s: float = 2.0, idle_timeout_s: float = 30.0,
                 resubmits: int = 1, model: str | None = None, sampling: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None, inboxes: Inboxes | None = None,
                 session: str | None = None, engine: dict[str, Any] | None = None,
                 recover_s: float = RECOVER_S, resume_s: float | None = None,
                 fit_context: bool = False, prompt_ids: Sequence[int] | None = None) -> AsyncIterator[Reply]:
    """``max_tokens`` None: up to the rest of the chosen engine's context (``max_tokens_rest``,
    vLLM's default); ``fit_context``: ``max_tokens`` is a cap, fitted into the rest of the chosen
    engine's context (where vLLM would refuse the request); ``model``: only that model's instances are candidates (served or predictor name);
    ``session``: the conversation the query belongs to (session-affinity routing);
    ``sampling``: engine sampling fields (``bear.protocol.sampling``); ``engine``: more engine
    fields, forwarded verbatim (``bear.protocol.engine_fields``: the answer's chunks then carry
    the engine's ``choices``); ``headers``: NATS headers of
    the submission (the trace context); ``inboxes``: a shared reply subscription (else one of its
    own per call); ``recover_s``: the silence after which the terminal record is read (0: never),
    and how often a gap in the chunks is asked for again; ``resume_s`` (default ``RESUME_S``): how
    long a gap may stay open after the terminal message before the answer ends ``incomplete``.
    ``prompt_ids``: a token-id prompt (the engine is sent these ids; ``prompt`` is their text where
    known, the predictor's input; ``model`` is required).
    Yields the typed messages of ``bear.protocol.replies`` (``Routed``, ``Chunk``, ``Done``, ``Error``)."""
    from nats.errors import TimeoutError as NatsTimeout

    subjects = subjects or Subjects()
    qid = query_id or uuid.uuid4().hex
    nonce = secrets.token_hex(8)  # the router echoes it in every message of this query's stream
    try:
        req = Submit(query_id=qid, ttft_target_s=ttft_target_s, deadline=time.time() + accept_timeout_s * (resubmits + 1),
                     nonce=nonce, max_tokens=max_tokens, max_tokens_rest=max_tokens is None or fit_context,
                     messages=messages, prompt=None if messages is not None else prompt or "", lam=lam,
                     prompt_tokens=prompt_tokens, model=model, sampling=sampling or None, session=session,
                     engine=engine or None, prompt_ids=None if prompt_ids is None else pack(prompt_ids))
    except (ValueError, OverflowError) as exc:  # the router would refuse it (bear.protocol.submit): say why, send nothing
        yield error_event(ErrorCode.BAD_REQUEST, str(exc), query_id=qid, client=True)
        return
    payload = encode(req)
    limit = getattr(nc, "max_payload", 0)
    if isinstance(limit, int) and 0 < limit < len(payload):  # NATS would refuse it: say why, send nothing
        yield error_event(ErrorCode.TOO_LARGE, f"query of {len(payload)} bytes exceeds the NATS server's "
                                               f"max_payload of {limit} bytes", query_id=qid, client=True)
        return
    sub: Any = None
    if inboxes is not None:
        inbox, queue = inboxes.open()
    else:
        inbox = nc.new_inbox()
        queue = asyncio.Queue()
        sub = await nc.subscribe(inbox, cb=queue.put)
    answered = False  # the router's terminal message arrived: nothing to cancel
    submit_subject = subjects.submit_for_inbox(inbox)  # bear.submit.<identity>: answered only into its inbox
    foreign = 0
    order = ChunkOrder()  # the chunks in seq order; a gap asked for again (bear.resend/1)
    resume = RESUME_S if resume_s is None else resume_s
    ask_every = recover_s if recover_s > 0 else RECOVER_S
    held: Done | None = None  # the router's done, held until every chunk before it is here
    gap_at = 0.0  # when the open gap was seen, or last narrowed
    asked_at = -math.inf  # the last bear.resend/1
    loop = asyncio.get_running_loop()

    async def ask() -> None:
        nonlocal asked_at
        asked_at = loop.time()
        RESUMED["requests"] += 1
        try:
            await nc.publish(subjects.cancel, encode(Resend(query_id=qid, inbox=inbox, nonce=nonce,
                                                            missing=order.missing())))
        except Exception:  # NATS away: asked again in ask_every
            pass

    try:
        await nc.publish(submit_subject, payload, reply=inbox, headers=headers)
        heard = False
        left = resubmits
        duplicate = False
        takeover_until = -math.inf  # a takeover asked for: the wait for it to start goes on until then
        since = loop.time()  # the last message (or the submission)
        recover_every = recover_s  # doubles after each read that found nothing (back to recover_s on news)
        reconnects = _reconnects(nc)
        while True:
            wait = idle_timeout_s if heard else accept_timeout_s
            now = loop.time()
            left_s = max(0.0, since + wait - now)
            if _reconnects(nc) != reconnects:  # the connection came back since the submission: a terminal
                recover_every = recover_s  # message may have been lost — read every recover_s from now on
            within = min(left_s, recover_every) if recover_s > 0 else left_s
            gap = not order.whole
            if gap:  # ask again in ask_every; with the done here, give up resume_s after the last progress
                within = min(within, max(0.0, asked_at + ask_every - now))
                if held is not None:
                    within = max(0.0, min(asked_at + ask_every, gap_at + resume) - now)
            d: Reply | None = None
            try:
                msg = await next_reply(queue, within)
            except (NatsTimeout, TimeoutError):
                now = loop.time()
                if gap:
                    if held is not None and now >= gap_at + resume:
                        RESUMED["incomplete"] += 1
                        answered = True  # the router's done came: nothing to cancel
                        log.warning("answer incomplete: chunks lost", query_id=qid, lost=order.lost())
                        yield error_event(ErrorCode.INCOMPLETE, order.describe(), query_id=qid, client=True)
                        return
                    if now >= asked_at + ask_every:
                        await ask()
                    if held is not None:
                        continue
                if recover_s > 0:  # silent: the router's terminal message may have been lost
                    if _reconnects(nc) == reconnects:  # no reconnect: most likely a slow first token
                        recover_every = min(2.0 * recover_every, max(recover_s, idle_timeout_s))
                    rec = await terminal_record(nc, subjects, inbox, qid, nonce)
                    if rec is not None:
                        RECOVERED["terminals"] += 1
                        log.info("terminal message read from its record", query_id=qid, v=rec.v)
                        d = rec
                    else:
                        if (heard or duplicate) and held is None:  # accepted, then silent: is its router gone?
                            takeover_until = await _ask_takeover(nc, submit_subject, req, inbox, headers, order.top,
                                                                 accept_timeout_s * (resubmits + 1))
                        if loop.time() < max(since + wait, takeover_until):
                            continue
                if d is None:
                    since = loop.time()
                    if not heard and left > 0:
                        left -= 1
                        try:
                            await nc.publish(submit_subject, payload, reply=inbox, headers=headers)
                        except Exception:
                            pass
                        continue
                    what = "no router answered" if not heard else f"stream silent for {idle_timeout_s}s"
                    if duplicate and not heard:
                        what = "query_id was already submitted and its answer did not arrive here"
                    if gap:
                        what += f"; {order.describe()}"
                    yield error_event(ErrorCode.DEADLINE_EXCEEDED if heard else ErrorCode.UNAVAILABLE, what,
                                      query_id=qid, client=True)
                    return
            else:
                d = decode_reply(msg.data)
                if d is None:  # not a reply-stream message
                    continue
                if d.query_id != qid or d.nonce != nonce:  # not of this query: injected or stray
                    foreign += 1
                    FOREIGN_DROPPED["messages"] += 1
                    continue
                if isinstance(d, Error) and d.code == ErrorCode.DUPLICATE and (heard or left < resubmits):
                    # our own resubmission (or takeover) hit the dedup: the original stream comes to
                    # this inbox. Not news of the answer: the silence it is in goes on
                    duplicate = True
                    continue
                since, recover_every = loop.time(), recover_s
                heard = True
            if isinstance(d, Chunk):
                was_whole = order.whole
                due = order.add(d)
                if order.overflow:  # too far behind a gap to hold more
                    RESUMED["incomplete"] += 1
                    log.warning("answer incomplete: too many chunks behind a gap", query_id=qid, lost=order.lost())
                    yield error_event(ErrorCode.INCOMPLETE, order.describe(), query_id=qid, client=True)
                    return
                if was_whole != order.whole or (due and not was_whole):  # a gap opened, or narrowed
                    gap_at = loop.time()
                for c in due:
                    yield c
                if order.whole:
                    if held is not None:  # the gap before the done filled: the answer is whole
                        RESUMED["answers"] += 1
                        RESUMED["chunks"] += order.filled
                        answered = True
                        yield held
                        return
                elif loop.time() >= asked_at + ask_every:
                    await ask()
                continue
            if isinstance(d, Done):
                if held is not None:  # the same done again (re-sent after a reconnect, or its record)
                    continue
                order.end(None if d.chunks is UNSET else d.chunks)
                if not order.whole:  # chunks before it missing: held until they come, or resume_s
                    held, gap_at = d, loop.time()
                    log.info("chunks missing at the end of the answer; asked again", query_id=qid,
                             missing=order.lost())
                    await ask()
                    continue
                if order.gapped:
                    RESUMED["answers"] += 1
                    RESUMED["chunks"] += order.filled
            answered = is_terminal(d)
            yield d
            if answered:
                return
    finally:
        if foreign:
            log.warning("messages not of this query dropped", query_id=qid, inbox=inbox, dropped=foreign)
        if inboxes is not None:
            inboxes.close(inbox)
        else:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        if not answered:
            await cancel(nc, qid, inbox, subjects)


async def cancel(nc: Any, query_id: str, inbox: str, subjects: Subjects | None = None) -> None:
    """Tell the routers that nobody waits for ``query_id`` (answered to ``inbox``) any more (best
    effort: with NATS down the generation runs to its end)."""
    try:
        await nc.publish((subjects or Subjects()).cancel, encode(Cancel(query_id=query_id, inbox=inbox)))
    except Exception:
        pass
