"""bear.submit/1 and bear.cancel/1 as structs (bear.protocol.submit): what the client builds is
what the router decodes, and bad input gets the router's coded bad_request with its message."""

from __future__ import annotations

import math

import msgpack
import pytest

from bear.protocol import schemas
from bear.protocol.codec import pack, unpack
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import encode
from bear.protocol.submit import Cancel, Submit, decode_cancel, decode_submit


def test_a_submit_round_trips_and_omits_what_is_unset() -> None:
    s = Submit(query_id="q", prompt="hi", ttft_target_s=0.5, max_tokens=7, nonce="n1")
    wire = unpack(encode(s))
    assert wire == {"v": schemas.SUBMIT, "query_id": "q", "prompt": "hi", "ttft_target_s": 0.5, "max_tokens": 7,
                    "nonce": "n1"}
    assert decode_submit(encode(s)) == s
    # the dict form senders built before the struct decodes the same (v optional)
    assert decode_submit(pack({k: v for k, v in wire.items() if k != "v"})) == s


@pytest.mark.parametrize(("fields", "message"), [
    ({"query_id": ""}, "query_id must be a non-empty string"),
    ({"query_id": 3}, "query_id must be a non-empty string"),
    ({"query_id": "x" * 257}, "query_id must be a non-empty string"),
    ({"prompt": None}, "exactly one of prompt or messages is required"),
    ({"messages": [{"role": "user", "content": "x"}]}, "exactly one of prompt or messages is required"),
    ({"prompt": 3}, "prompt must be a string"),
    ({"prompt": None, "messages": ["x"]}, "messages must be a list of maps"),
    ({"ttft_target_s": -1}, "ttft_target_s must be a number ≥ 0.0"),
    ({"ttft_target_s": math.inf}, "ttft_target_s must be a number ≥ 0.0"),
    ({"ttft_target_s": True}, "ttft_target_s must be a number ≥ 0.0"),
    ({"lam": math.nan}, "lam must be a number ≥ 0.0"),
    ({"max_tokens": 0}, "max_tokens must be a number ≥ 1"),
    ({"max_tokens": 2**31}, "max_tokens must be < 2^31"),
    ({"max_tokens_rest": 1}, "max_tokens_rest must be a boolean"),
    ({"prompt_tokens": -1}, "prompt_tokens must be a non-negative integer"),
    ({"prompt_tokens": False}, "prompt_tokens must be a non-negative integer"),
    ({"model": ""}, "model must be a non-empty string"),
    ({"deadline": math.inf}, "deadline must be a finite number"),
    ({"session": 5}, "session must be a non-empty string"),
    ({"nonce": "n" * 65}, "nonce must be a non-empty string (≤ 64 chars)"),
    ({"sampling": [1]}, "sampling must be a map"),
    ({"engine": "tools"}, "engine must be a map"),
    ({"v": "other"}, f"expected v={schemas.SUBMIT}"),
])
def test_bad_submits_are_coded_with_the_field_named(fields: dict, message: str) -> None:
    raw = {"query_id": "q", "prompt": "x", **fields}
    with pytest.raises(BearError) as e:
        decode_submit(pack({k: v for k, v in raw.items() if v is not None or k != "prompt"}))
    assert e.value.code == ErrorCode.BAD_REQUEST
    assert e.value.message.startswith(message), e.value.message


def test_undecodable_deep_or_huge_submits_are_coded() -> None:
    for data in (b"\xc1", pack([1, 2]), b"\x81\xa8messages" + b"\x91" * 5000 + b"\xc0"):
        with pytest.raises(BearError) as e:
            decode_submit(data)
        assert e.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(BearError) as e:
        decode_submit(pack({"query_id": "q", "prompt": "x"}), max_bytes=4)
    assert e.value.code == ErrorCode.TOO_LARGE


def test_a_missing_query_id_is_named() -> None:
    with pytest.raises(BearError) as e:
        decode_submit(msgpack.packb({"prompt": "x"}))
    assert e.value.message.startswith("query_id must be")


def test_cancel_round_trips_and_junk_is_none() -> None:
    c = Cancel(query_id="q", inbox="_INBOX.x")
    assert unpack(encode(c)) == {"v": schemas.CANCEL, "query_id": "q", "inbox": "_INBOX.x"}
    assert decode_cancel(encode(c)) == c
    for junk in (b"\xc1", pack([1, 2]), pack({"v": "other", "query_id": "x", "inbox": "i"}),
                 pack({"v": schemas.CANCEL, "query_id": 3, "inbox": "i"}), pack({"query_id": "q", "inbox": ""})):
        assert decode_cancel(junk) is None
