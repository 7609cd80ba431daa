"""Stable error codes carried by every error reply (design.md §7)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from bear.protocol import schemas


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


class BearError(Exception):
    """An error with a stable code, turned into an error reply at service boundaries."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def reply(self) -> dict[str, Any]:
        return error_reply(self.code, self.message)


def error_reply(code: ErrorCode, message: str) -> dict[str, Any]:
    """The map every service returns on failure: ``{"v": "bear.error/1", "error": {code, message}}``."""
    return {"v": schemas.ERROR, "error": {"code": str(code), "message": message}}


def is_error(reply: Any) -> bool:
    return isinstance(reply, dict) and isinstance(reply.get("error"), dict)


def error_of(reply: dict[str, Any]) -> BearError:
    """The ``BearError`` an error reply carries (an unknown code reads as ``internal``)."""
    err = reply.get("error") or {}
    code = err.get("code") if isinstance(err, dict) else None
    known = ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
    return BearError(known, str(err.get("message", "")) if isinstance(err, dict) else "")
