"""The client side of ``bear.submit``: ``submit()`` publishes one query with a reply inbox and
returns an async iterator over the router's messages — ``bear.routed/1`` (possibly again, with
``attempt`` 2, when the first instance did not answer), ``bear.chunk/1`` text pieces, then exactly
one terminal ``bear.done/1`` or ``bear.error/1``.

No answer within ``accept_timeout_s`` (no router, or the submission was lost in a NATS restart)
→ the same ``query_id`` is resubmitted (routers deduplicate ids, so it never runs twice); still
nothing, or a stream silent for ``idle_timeout_s`` → a client-made ``bear.error/1`` (``client:
true``), so the caller always gets a terminal message. A query larger than the NATS server's
``max_payload`` is not sent: it gets a client-made ``too_large`` error at once."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from bear.protocol.codec import pack, unpack_map
from bear.protocol.errors import BearError, ErrorCode, error_reply
from bear.protocol.subjects import Subjects

TERMINAL = ("bear.done/1", "bear.error/1")


def is_terminal(msg: dict[str, Any]) -> bool:
    return msg.get("v") in TERMINAL


async def submit(nc: Any, prompt: str | None = None, *, ttft_target_s: float = 1.0, max_tokens: int = 256,
                 lam: float | None = None, query_id: str | None = None, messages: list[dict[str, Any]] | None = None,
                 prompt_tokens: int | None = None, sim_output_tokens: int | dict[str, int] | None = None,
                 subjects: Subjects | None = None, accept_timeout_s: float = 2.0, idle_timeout_s: float = 30.0,
                 resubmits: int = 1) -> AsyncIterator[dict[str, Any]]:
    from nats.errors import TimeoutError as NatsTimeout

    subjects = subjects or Subjects()
    qid = query_id or uuid.uuid4().hex
    req: dict[str, Any] = {"v": "bear.submit/1", "query_id": qid, "ttft_target_s": ttft_target_s,
                           "max_tokens": max_tokens}
    if messages is not None:
        req["messages"] = messages
    else:
        req["prompt"] = prompt or ""
    for key, val in (("lam", lam), ("prompt_tokens", prompt_tokens), ("sim_output_tokens", sim_output_tokens)):
        if val is not None:
            req[key] = val
    payload = pack(req)
    limit = getattr(nc, "max_payload", 0)
    if isinstance(limit, int) and 0 < limit < len(payload):  # NATS would refuse it: say why, send nothing
        m = error_reply(ErrorCode.TOO_LARGE, f"query of {len(payload)} bytes exceeds the NATS server's "
                                             f"max_payload of {limit} bytes")
        m.update(query_id=qid, client=True)
        yield m
        return
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subjects.submit, payload, reply=inbox)
        heard = False
        left = resubmits
        duplicate = False
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_timeout_s if heard else accept_timeout_s)
            except (NatsTimeout, TimeoutError):
                if not heard and left > 0:
                    left -= 1
                    try:
                        await nc.publish(subjects.submit, payload, reply=inbox)
                    except Exception:
                        pass
                    continue
                what = "no router answered" if not heard else f"stream silent for {idle_timeout_s}s"
                if duplicate and not heard:
                    what = "query_id was already submitted and its answer did not arrive here"
                m = error_reply(ErrorCode.DEADLINE_EXCEEDED if heard else ErrorCode.UNAVAILABLE, what)
                m.update(query_id=qid, client=True)
                yield m
                return
            try:
                d = unpack_map(msg.data)
            except BearError:
                continue
            code = (d.get("error") or {}).get("code") if isinstance(d.get("error"), dict) else None
            if code == ErrorCode.DUPLICATE and (heard or left < resubmits):
                # our own resubmission hit the dedup: the original stream comes to this inbox
                duplicate = True
                continue
            heard = True
            yield d
            if is_terminal(d):
                return
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
