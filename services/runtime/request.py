"""Request-reply with a deadline and a retry, as design.md §7 asks of every caller: each try gets
a timeout shorter than what is left of the budget, a try that times out (the responder died or is
slow) or answers ``overloaded`` is sent again — the queue group hands it to another responder —
and the caller gets the reply bytes or one coded ``BearError``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from bear.protocol.deadline import Deadline
from bear.protocol.errors import BearError, ErrorCode, error_of


@dataclass
class RequestStats:
    """What a caller's requests went through (for its metrics and tests)."""

    tries: int = 0
    timeouts: int = 0  # tries that got no answer in their timeout
    refused: int = 0  # answers ``accept`` refused (no real responder sends them)


class _ErrorProbe(msgspec.Struct):
    error: dict[str, Any] | None = None


_probe = msgspec.msgpack.Decoder(_ErrorProbe)


def error_in(data: bytes) -> BearError | None:
    """The error a reply carries, if it is an error reply (cheap: only the ``error`` key is read)."""
    try:
        e = _probe.decode(data).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return error_of({"error": e}) if e is not None else None


async def request(nc: Any, subject: str, payload: bytes, *, deadline: Deadline, try_timeout_s: float,
                  retries: int = 1, headers: dict[str, str] | None = None,
                  stats: RequestStats | None = None, accept: Callable[[bytes], bool] | None = None) -> bytes:
    """The reply to ``payload`` (an error reply is returned as is, unless it says ``overloaded``
    and a retry is left). ``accept``: a reply it refuses (one no real responder sends: a leaked
    credential's, bear.router.reply_bounds) counts as no answer — tried again while a retry is
    left (the queue group hands it to another member). Raises BearError: ``unavailable`` (no
    responder, connection closed), ``deadline_exceeded`` (every try timed out) or ``bad_request``
    (the last answer refused)."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    last: Exception | None = None
    data = b""
    for attempt in range(retries + 1):
        timeout = deadline.timeout(try_timeout_s)
        if timeout <= 0.0:
            break
        if stats is not None:
            stats.tries += 1
        try:
            msg = await nc.request(subject, payload, timeout=timeout, headers=headers)
        except (NatsTimeout, TimeoutError) as exc:
            last = exc
            if stats is not None:
                stats.timeouts += 1
            continue
        except NoRespondersError as exc:
            raise BearError(ErrorCode.UNAVAILABLE, f"nobody serves {subject}") from exc
        except Exception as exc:  # connection closed or reconnecting
            raise BearError(ErrorCode.UNAVAILABLE, f"{subject}: {exc!r}") from exc
        data = msg.data
        err = error_in(data)
        if err is not None and err.code == ErrorCode.OVERLOADED and attempt < retries:
            continue
        if accept is not None and err is None and not accept(data):
            if stats is not None:
                stats.refused += 1
            data, last = b"", BearError(ErrorCode.BAD_REQUEST, f"refused reply on {subject}")
            continue
        return data
    if isinstance(last, BearError):
        raise last
    if data:
        return data  # the last answer was `overloaded`
    raise BearError(ErrorCode.DEADLINE_EXCEEDED, f"no answer on {subject} in time: {last!r}")
