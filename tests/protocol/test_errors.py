"""A service's error reply as a struct (bear.protocol.errors.ErrorReply, issue 25): the same
msgpack bytes as the map every service built before, and read back the same ways."""

from __future__ import annotations

import msgpack
import pytest

from bear.protocol import schemas
from bear.protocol.codec import pack, unpack
from bear.protocol.errors import BearError, ErrorCode, ErrorReply, error_of, error_reply, is_error
from bear.protocol.messages import decode, encode
from bear.runtime.request import error_in


def _old(code: ErrorCode | str, message: str) -> dict:
    """The map ``error_reply`` returned before it was a struct."""
    return {"v": schemas.ERROR, "error": {"code": str(code), "message": message}}


@pytest.mark.parametrize(("code", "message"), [
    (ErrorCode.BAD_REQUEST, "malformed request: KeyError"),
    (ErrorCode.OVERLOADED, "at most 20 resyncs/s; retry"),
    (ErrorCode.NOT_FOUND, "i1 has published no state yet"),
    (ErrorCode.INTERNAL, "RuntimeError('x' * 300)" * 10),  # a message over 255 bytes (str16)
    (ErrorCode.DEADLINE_EXCEEDED, ""),
    (ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt of 9000 tokens + max_tokens 100 > 8192 — ünïcode"),
])
def test_error_reply_is_the_bytes_of_the_old_map(code: ErrorCode, message: str) -> None:
    old = _old(code, message)
    assert encode(error_reply(code, message)) == pack(old) == msgpack.packb(old, use_bin_type=True)
    assert encode(BearError(code, message).reply()) == pack(old)


def test_error_reply_reads_back() -> None:
    data = encode(error_reply(ErrorCode.OVERLOADED, "busy"))
    generic = unpack(data)
    assert is_error(generic) and generic == _old("overloaded", "busy")
    err = error_of(generic)
    assert err.code is ErrorCode.OVERLOADED and err.message == "busy"
    typed = decode(ErrorReply, data)
    assert is_error(typed) and typed.code == "overloaded" and typed["error"]["message"] == "busy"
    assert typed.get("v") == schemas.ERROR
    assert error_of(typed).code is ErrorCode.OVERLOADED
    found = error_in(data)
    assert found is not None and found.code is ErrorCode.OVERLOADED and found.message == "busy"


def test_not_an_error() -> None:
    assert not is_error({"v": schemas.PREDICTION, "models": {}})
    assert not is_error({"error": "a string"})
    assert error_in(pack({"v": schemas.PREDICTION, "models": {}})) is None
    assert error_of({"error": {"code": "no_such_code", "message": "m"}}).code is ErrorCode.INTERNAL
