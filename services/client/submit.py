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
and nonce is dropped and counted (``FOREIGN_DROPPED``), never yielded (issue 26)."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog

from bear.protocol import schemas
from bear.protocol.errors import ErrorCode
from bear.protocol.messages import encode
from bear.protocol.replies import Done, Error, Reply, decode_reply, error_event
from bear.protocol.subjects import Subjects
from bear.protocol.submit import Cancel, Submit

log = structlog.get_logger("bear.client")

TERMINAL = schemas.TERMINAL
# Messages that reached a submission's inbox but are not of its query (another query id, or not
# the per-query nonce the router echoes): dropped, counted here, one warning line per submission.
FOREIGN_DROPPED = {"messages": 0}
# Terminal messages read from the routers' terminal records (their own message was lost), and reads.
RECOVERED = {"terminals": 0, "reads": 0}
RECOVER_S = 1.0  # the silence after which a submission reads its terminal record


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


async def submit(nc: Any, prompt: str | None = None, *, ttft_target_s: float = 1.0, max_tokens: int | None = 256,
                 lam: float | None = None, query_id: str | None = None, messages: list[dict[str, Any]] | None = None,
                 prompt_tokens: int | None = None,
                 subjects: Subjects | None = None, accept_timeout_s: float = 2.0, idle_timeout_s: float = 30.0,
                 resubmits: int = 1, model: str | None = None, sampling: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None, inboxes: Inboxes | None = None,
                 session: str | None = None, engine: dict[str, Any] | None = None,
                 recover_s: float = RECOVER_S) -> AsyncIterator[Reply]:
    """``max_tokens`` None: up to the rest of the chosen engine's context (``max_tokens_rest``,
    vLLM's default); ``model``: only that model's instances are candidates (served or predictor name);
    ``session``: the conversation the query belongs to (session-affinity routing);
    ``sampling``: engine sampling fields (``bear.protocol.sampling``); ``engine``: more engine
    fields, forwarded verbatim (``bear.protocol.engine_fields``: the answer's chunks then carry
    the engine's ``choices``); ``headers``: NATS headers of
    the submission (the trace context); ``inboxes``: a shared reply subscription (else one of its
    own per call); ``recover_s``: the silence after which the terminal record is read (0: never).
    Yields the typed messages of ``bear.protocol.replies`` (``Routed``, ``Chunk``, ``Done``, ``Error``)."""
    from nats.errors import TimeoutError as NatsTimeout

    subjects = subjects or Subjects()
    qid = query_id or uuid.uuid4().hex
    nonce = secrets.token_hex(8)  # the router echoes it in every message of this query's stream
    try:
        req = Submit(query_id=qid, ttft_target_s=ttft_target_s, deadline=time.time() + accept_timeout_s * (resubmits + 1),
                     nonce=nonce, max_tokens=max_tokens, max_tokens_rest=max_tokens is None,
                     messages=messages, prompt=None if messages is not None else prompt or "", lam=lam,
                     prompt_tokens=prompt_tokens, model=model, sampling=sampling or None, session=session,
                     engine=engine or None)
    except ValueError as exc:  # the router would refuse it (bear.protocol.submit): say why, send nothing
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
    try:
        await nc.publish(submit_subject, payload, reply=inbox, headers=headers)
        heard = False
        left = resubmits
        duplicate = False
        loop = asyncio.get_running_loop()
        since = loop.time()  # the last message (or the submission)
        recover_every = recover_s  # doubles after each read that found nothing (back to recover_s on news)
        reconnects = _reconnects(nc)
        while True:
            wait = idle_timeout_s if heard else accept_timeout_s
            left_s = max(0.0, since + wait - loop.time())
            if _reconnects(nc) != reconnects:  # the connection came back since the submission: a terminal
                recover_every = recover_s  # message may have been lost — read every recover_s from now on
            try:
                msg = await next_reply(queue, min(left_s, recover_every) if recover_s > 0 else left_s)
            except (NatsTimeout, TimeoutError):
                if recover_s > 0:  # silent: the router's terminal message may have been lost
                    if _reconnects(nc) == reconnects:  # no reconnect: most likely a slow first token
                        recover_every = min(2.0 * recover_every, max(recover_s, idle_timeout_s))
                    rec = await terminal_record(nc, subjects, inbox, qid, nonce)
                    if rec is not None:
                        RECOVERED["terminals"] += 1
                        log.info("terminal message read from its record", query_id=qid, v=rec.v)
                        answered = True
                        yield rec
                        return
                    if loop.time() < since + wait:
                        continue
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
                yield error_event(ErrorCode.DEADLINE_EXCEEDED if heard else ErrorCode.UNAVAILABLE, what,
                                  query_id=qid, client=True)
                return
            since, recover_every = loop.time(), recover_s
            d = decode_reply(msg.data)
            if d is None:  # not a reply-stream message
                continue
            if d.query_id != qid or d.nonce != nonce:  # not of this query: injected or stray
                foreign += 1
                FOREIGN_DROPPED["messages"] += 1
                continue
            if isinstance(d, Error) and d.code == ErrorCode.DUPLICATE and (heard or left < resubmits):
                # our own resubmission hit the dedup: the original stream comes to this inbox
                duplicate = True
                continue
            heard = True
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
