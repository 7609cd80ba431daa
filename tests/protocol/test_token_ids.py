"""Token ids on the wire (``bear.protocol.token_ids``): packed little-endian uint32 in one msgpack
``bin`` field, the older list of ints still accepted, a ragged packed field refused with a coded
error; both forms read back as the same ids."""

from __future__ import annotations

import pytest

from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import MAX_PROMPT_TOKEN_IDS, EstimateQuery, EstimateRequest, decode, encode
from bear.protocol.token_ids import count, pack, unpack

IDS = [0, 1, 255, 256, 65_535, 65_536, 2**31 - 1, 2**31, 2**32 - 1, 151_643]


def test_pack_is_little_endian_uint32() -> None:
    assert pack([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    assert list(unpack(pack(IDS))) == IDS and count(pack(IDS)) == len(IDS) == count(IDS)
    assert unpack(IDS) is IDS
    with pytest.raises(OverflowError):
        pack([2**32])
    with pytest.raises(ValueError, match="multiple of 4"):
        unpack(b"\x00" * 5)


def _request(tokens: dict) -> bytes:
    return encode({"v": "bear.estimate/1", "query": {"id": "q", "prompt_tokens": 1}, "instances": ["a"],
                   "tokens": tokens})


def test_both_wire_forms_decode_to_the_same_ids() -> None:
    packed = decode(EstimateRequest, _request({"t": pack(IDS)}))
    listed = decode(EstimateRequest, _request({"t": IDS}))
    assert isinstance(packed.tokens["t"], bytes) and isinstance(listed.tokens["t"], list)
    assert list(unpack(packed.tokens["t"])) == list(unpack(listed.tokens["t"])) == IDS
    out = EstimateRequest(query=EstimateQuery(prompt_tokens=1), instances=["a"], tokens={"t": pack(IDS)})
    assert decode(EstimateRequest, encode(out)).tokens == {"t": pack(IDS)}


@pytest.mark.parametrize("bad", [b"\x00" * 7, [-1], [2**32], "text"])
def test_bad_token_fields_are_coded_errors(bad: object) -> None:
    with pytest.raises(BearError) as err:
        decode(EstimateRequest, _request({"t": bad}))
    assert err.value.code == ErrorCode.BAD_REQUEST and "tokens" in err.value.message


def test_packed_field_bounded() -> None:
    """At most MAX_PROMPT_TOKEN_IDS ids in either form, whatever the message size limit allows."""
    big = _request({"t": b"\x00" * (4 * MAX_PROMPT_TOKEN_IDS + 4)})
    with pytest.raises(BearError) as err:
        decode(EstimateRequest, big, max_bytes=len(big))
    assert err.value.code == ErrorCode.BAD_REQUEST
    ok = _request({"t": b"\x00" * (4 * MAX_PROMPT_TOKEN_IDS)})
    assert count(decode(EstimateRequest, ok, max_bytes=len(ok)).tokens["t"]) == MAX_PROMPT_TOKEN_IDS
