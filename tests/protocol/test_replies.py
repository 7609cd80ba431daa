"""The reply stream as a tagged union (bear.protocol.replies): a router's messages encoded with the
structs are the same msgpack bytes as the maps the router built before (field for field, in the
same order), and the client decodes them, and only them, back."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bear.protocol import schemas
from bear.protocol.codec import pack
from bear.protocol.errors import ErrorBody, ErrorCode, ErrorReply, error_reply
from bear.protocol.replies import Chunk, Done, Error, Routed, decode_reply, encode_reply, error_event

ROUTED = {"v": schemas.ROUTED, "instance": "i1", "model": "m/a", "predictor_model": "a", "predicted_ttft_s": 0.25,
          "ttft_method": "bea", "feasible": True, "policy": "bear", "decision_s": 0.0012, "attempt": 1,
          "backend": "vllm", "prompt_tokens": 37, "prompt_tokens_exact": True}
DONE = {"v": schemas.DONE, "instance": "i1", "model": "m/a", "predictor_model": "a", "ttft_s": 0.31,
        "target_s": 0.5, "on_time": True, "utility": 0.75, "predicted_utility": -math.inf, "predicted_ttft_s": None,
        "usage": {"prompt_tokens": 37, "completion_tokens": 3, "total_tokens": 40}, "finish_reason": "length",
        "decision_s": 0.0012}


def _stamped(d: dict, qid: str = "q1", nonce: str | None = "ab12") -> dict:
    """As ClientStream stamped the maps: query_id, then the nonce (when the submit had one), last."""
    out = {**d, "query_id": qid}
    if nonce is not None:
        out["nonce"] = nonce
    return out


def _fields(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "v"}


@pytest.mark.parametrize("nonce", ["ab12", None])
def test_routed_and_done_are_the_bytes_the_router_built(nonce: str | None) -> None:
    for kind, d in ((Routed, ROUTED), (Done, DONE)):
        want = _stamped(d, nonce=nonce)
        if kind is Done:  # since issue 40 a router's done says how many chunks the answer had, last
            want["chunks"] = 3
        got = encode_reply(kind(**_fields(want)))
        assert _entries(got) == _entries(pack(want)), kind
        assert decode_reply(got) == kind(**_fields(want))


def _entries(data: bytes) -> bytes:
    """A msgpack map's entries, byte for byte, without its header: msgspec sizes the header for
    all of a struct's fields (a map16 once a struct has more than 15, as ``Done`` since issue 40),
    packing a dict for the entries it has."""
    if data[0] & 0xF0 == 0x80:  # fixmap
        return data[1:]
    assert data[0] == 0xDE, "a map16"
    return data[3:]


def test_chunks_are_the_bytes_the_router_built() -> None:
    text = _stamped({"v": schemas.CHUNK, "seq": 0, "text": "Hello"})
    relay = _stamped({"v": schemas.CHUNK, "seq": 3, "choices": [{"index": 0, "delta": {"content": "x"}}]})
    for d in (text, relay):
        assert encode_reply(Chunk(**_fields(d))) == pack(d)
    c = decode_reply(pack(relay))
    assert isinstance(c, Chunk) and not c.text and c.choices == relay["choices"] and "text" not in c


def test_errors_are_the_bytes_the_router_and_client_built() -> None:
    router = _stamped({"v": schemas.ERROR, "error": {"code": "unavailable", "message": "instance stream failed"},
                       "instance": "i1"})
    assert encode_reply(error_event(ErrorCode.UNAVAILABLE, "instance stream failed", instance="i1", query_id="q1",
                                    nonce="ab12")) == pack(router)
    client = {"v": schemas.ERROR, "error": {"code": "deadline_exceeded", "message": "stream silent"},
              "query_id": "q1", "client": True}
    e = error_event(ErrorCode.DEADLINE_EXCEEDED, "stream silent", query_id="q1", client=True)
    assert encode_reply(e) == pack(client)
    back = decode_reply(pack(router))
    assert isinstance(back, Error) and back.terminal and back.code == "unavailable" and back.instance == "i1"
    assert back.client is not True
    # one body type: a service's error reply and the stream's error share it, and read alike
    assert type(back.error) is type(error_reply(ErrorCode.UNAVAILABLE, "x").error) and isinstance(back.error, ErrorBody)
    assert ErrorReply.__struct_fields__ == ("error",)


def test_numpy_numbers_encode_as_python_numbers() -> None:
    d = _stamped(ROUTED)
    r = Routed(**{**_fields(d), "decision_s": np.float64(d["decision_s"]), "prompt_tokens": np.int64(37)})
    assert encode_reply(r) == pack(d)


def test_by_name_access_and_as_dict() -> None:
    r = decode_reply(pack(_stamped(ROUTED)))
    assert isinstance(r, Routed) and r["v"] == schemas.ROUTED and r["instance"] == "i1" and r.get("nope", 1) == 1
    assert r.as_dict() == _stamped(ROUTED)
    e = error_event("bad_request", "x", query_id="q")
    assert e["error"]["code"] == "bad_request" and "client" not in e and "nonce" not in e.as_dict()


def test_what_is_not_a_reply_decodes_to_none() -> None:
    for data in (b"\xc1", pack([1]), pack({"v": schemas.SUBMIT, "query_id": "q"}), pack({"instance": "i"}),
                 pack({"v": schemas.CHUNK, "seq": "x"})):
        assert decode_reply(data) is None
    partial = decode_reply(pack({"v": schemas.DONE, "query_id": "q"}))  # an older router's fewer fields
    assert isinstance(partial, Done) and partial.terminal and partial.ttft_s is None
