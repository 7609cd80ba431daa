"""Stable error codes carried by every error reply (design.md §7)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec

from bear.protocol import schemas
from bear.protocol.by_name import ByName


class ErrorCode(StrEnum):
    BAD_REQUEST = "bad_request"  # malformed or missing fields
    TOO_LARGE = "too_large"  # message or field beyond the service's limit
    # prompt + max_tokens beyond every candidate engine's context (OpenAI's and vLLM's own code)
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the request's absolute deadline passed
    UNAVAILABLE = "unavailable"  # a dependency (NATS, model, instance) is not reachable
    OVERLOADED = "overloaded"  # bounded queue full; retry elsewhere
    NOT_FOUND = "not_found"  # unknown instance / model
    INTERNAL = "internal"  # a bug: logged with a traceback
    DUPLICATE = "duplicate"  # a resubmitted query_id that is (or was) already executed
    # chunks of the answer were lost in transit (a NATS restart) and not sent again: the client
    # library's, its message names the chunks lost (an answer never ends ``done`` with a gap)
    INCOMPLETE = "incomplete"


class ErrorBody(ByName, msgspec.Struct):
    """``error`` of a ``bear.error/1``: a code of ``ErrorCode`` and why. One definition for a
    service's error reply and the reply stream's ``Error`` (``bear.protocol.replies``)."""

    code: str = "internal"
    message: str = ""


class ErrorFields:
    """``code`` and ``message`` of an error message's ``error`` body (the service reply's and the
    reply stream's)."""

    __slots__ = ()
    error: ErrorBody

    @property
    def code(self) -> str:
        return self.error.code

    @property
    def message(self) -> str:
        return self.error.message


class ErrorReply(ErrorFields, ByName, msgspec.Struct, tag_field="v", tag=schemas.ERROR, forbid_unknown_fields=False):
    """A service's error reply (``bear.resync``, ``bear.predict``, ``bear.estimate``):
    ``{"v": "bear.error/1", "error": {code, message}}`` — the bytes of the map it replaced.
    The reply stream's ``Error`` carries the same body plus its query's fields."""

    error: ErrorBody = msgspec.field(default_factory=ErrorBody)

    @property
    def v(self) -> str:
        return schemas.ERROR


class BearError(Exception):
    """An error with a stable code, turned into an error reply at service boundaries."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def reply(self) -> ErrorReply:
        return error_reply(self.code, self.message)


def error_reply(code: ErrorCode | str, message: str) -> ErrorReply:
    """The error reply every service returns on failure (encode it with msgspec:
    ``bear.protocol.messages.encode``)."""
    return ErrorReply(error=ErrorBody(code=str(code), message=message))


def is_error(reply: Any) -> bool:
    """Whether a decoded reply (a generic map, or an ``ErrorReply``) is an error reply."""
    return isinstance(reply, ErrorReply) or (isinstance(reply, dict) and isinstance(reply.get("error"), dict))


def error_of(reply: dict[str, Any] | ErrorReply) -> BearError:
    """The ``BearError`` an error reply carries (an unknown code reads as ``internal``)."""
    if isinstance(reply, ErrorReply):
        code: Any = reply.code
        message = reply.message
    else:
        err = reply.get("error") or {}
        code = err.get("code") if isinstance(err, dict) else None
        message = str(err.get("message", "")) if isinstance(err, dict) else ""
    known = ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
    return BearError(known, message)
