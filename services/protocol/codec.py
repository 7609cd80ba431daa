"""msgpack encoding shared by every subject; every message is a map with a ``v`` schema id."""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import msgspec

from bear.protocol.errors import BearError, ErrorCode

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_DEPTH = 64  # nesting of maps and lists: far beyond any BEAR message, far below Python's recursion limit


def plain_number(obj: Any) -> Any:
    """msgspec's ``enc_hook``: a numpy scalar (a producer's duration, a policy's float) as the
    Python number msgpack writes, as ``pack`` takes it."""
    item = getattr(obj, "item", None)
    if callable(item):
        return item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


STRUCT_ENCODER = msgspec.msgpack.Encoder(enc_hook=plain_number)  # typed messages that may hold numpy numbers


def pack(obj: Any) -> bytes:
    """Encode ``obj`` (maps, lists, str, int, float, bool, None, bytes) as msgpack."""
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def unpack(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """Decode msgpack bytes; malformed, oversized or deeper than ``max_depth`` input raises
    ``BearError`` (``too_large`` / ``bad_request``): a deep value would otherwise reach code that
    recurses over it (repr, JSON, validation) and fail there uncoded."""
    if len(data) > max_bytes:
        raise BearError(ErrorCode.TOO_LARGE, f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise BearError(ErrorCode.BAD_REQUEST, f"undecodable msgpack: {type(exc).__name__} {exc}"[:300]) from exc
    _check_depth(obj, max_depth)
    return obj


def _check_depth(obj: Any, max_depth: int) -> None:
    stack = [(obj, 0)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            if d >= max_depth:
                raise BearError(ErrorCode.BAD_REQUEST, f"message nested deeper than {max_depth} levels")
            stack.extend((v, d + 1) for v in o.values())
            stack.extend((k, d + 1) for k in o if isinstance(k, tuple))
        elif isinstance(o, list | tuple):
            if d >= max_depth:
                raise BearError(ErrorCode.BAD_REQUEST, f"message nested deeper than {max_depth} levels")
            stack.extend((v, d + 1) for v in o)


def unpack_map(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Decode a message that must be a map."""
    obj = unpack(data, max_bytes=max_bytes)
    if not isinstance(obj, dict):
        raise BearError(ErrorCode.BAD_REQUEST, "message is not a map")
    return obj


def json_line(o: Any) -> bytes:
    """``o`` as one line of strict JSON (the shape ``json_safe`` gives), newline included: orjson
    when installed (≈10× faster: the router writes one record per query on its event loop), else
    the standard library."""
    try:
        import orjson
    except ImportError:
        return json.dumps(json_safe(o), separators=(",", ":")).encode() + b"\n"
    try:
        return orjson.dumps(o, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
                            | orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # a type orjson does not know: the standard path decides
        return json.dumps(json_safe(o), separators=(",", ":")).encode() + b"\n"


def json_safe(o: Any) -> Any:
    """A copy of ``o`` that ``json.dumps`` writes as strict JSON: non-finite floats become null,
    tuples lists, keys strings (outcome logs, load summaries and evaluation results share it)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): json_safe(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [json_safe(v) for v in o]
    return o
