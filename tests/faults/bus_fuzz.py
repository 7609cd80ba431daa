"""A seeded generator of hostile msgpack messages: each one starts from a valid message of the
subject and is broken in one to three ways — a field dropped or replaced by a nasty value (deep
nesting, non-finite and out-of-range numbers, invalid UTF-8, msgpack extension types, bytes, huge
strings, non-string keys), a field added, the schema id changed — or the bytes themselves are
random, truncated or followed by garbage. Valid messages come out too, by chance, as they would
from a real sender."""

from __future__ import annotations

import math
import random
from typing import Any

import msgpack

BAD_UTF8 = "@@bad-utf8@@"
DEEP = "@@deep@@"


def _nasty(rng: random.Random) -> Any:
    pool: list[Any] = [
        None, True, False, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1e308, -1e308, math.inf, -math.inf,
        math.nan, 5e-324, "", "x" * rng.choice((1, 300, 70_000)), "\x00", "a.b", ">", "*", "bear.snapshot.>",
        "\u202e\ud7ff", BAD_UTF8, DEEP, [], {}, [None] * 2000, {str(k): k for k in range(200)}, {1: 2}, {(1, 2): 3},
        b"\xff" * rng.choice((1, 1000)), msgpack.ExtType(5, b"ext"), msgpack.Timestamp(1, 2), [[[[[]]]]],
        {"v": "bear.submit/1"}, [1.5, "x", None], rng.random(), rng.randint(-10, 10),
    ]
    return rng.choice(pool)


def _mutate_value(v: Any, rng: random.Random, depth: int = 0) -> Any:
    """``v`` (a map) with one field dropped, replaced, added — or a nested value changed."""
    if not isinstance(v, dict) or not v or depth > 3:
        return _nasty(rng)
    out = dict(v)
    key = rng.choice(list(out))
    op = rng.random()
    if op < 0.2:
        del out[key]
    elif op < 0.6:
        out[key] = _nasty(rng)
    elif op < 0.75:
        out[rng.choice(("extra", "v", "id", "instance", "time", "seq", "deadline", "t"))] = _nasty(rng)
    else:
        inner = out[key]
        if isinstance(inner, dict):
            out[key] = _mutate_value(inner, rng, depth + 1)
        elif isinstance(inner, list) and inner:
            lst = list(inner)
            i = rng.randrange(len(lst))
            lst[i] = _mutate_value(lst[i], rng, depth + 1) if isinstance(lst[i], dict) else _nasty(rng)
            out[key] = lst
        else:
            out[key] = _nasty(rng)
    return out


def pack_hostile(obj: Any, rng: random.Random) -> bytes:
    """msgpack of ``obj`` with the placeholders spliced as raw bytes (invalid UTF-8 in a str,
    nesting deeper than any packer writes)."""
    data = msgpack.packb(obj, use_bin_type=True, strict_types=False)
    if BAD_UTF8.encode() in data:
        data = data.replace(msgpack.packb(BAD_UTF8), b"\xa3\xff\xfe\xc3")
    if DEEP.encode() in data:
        n = rng.choice((70, 1000, 1100, 5000))
        data = data.replace(msgpack.packb(DEEP), b"\x91" * n + b"\xc0")
    return data


def hostile(base: Any, rng: random.Random) -> bytes:
    """One hostile message derived from the valid ``base``."""
    r = rng.random()
    valid = msgpack.packb(base, use_bin_type=True)
    if r < 0.05:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
    if r < 0.10:
        return valid[: rng.randrange(max(1, len(valid)))]
    if r < 0.13:
        return valid + b"\xc1garbage"
    if r < 0.16:
        return pack_hostile(_nasty(rng), rng)
    msg = base
    for _ in range(rng.randint(1, 3)):
        msg = _mutate_value(msg, rng)
    try:
        return pack_hostile(msg, rng)
    except (ValueError, TypeError, OverflowError):
        return valid[:-1]  # not packable as built: a truncated message instead


def kv_key(rng: random.Random, real: list[str]) -> str:
    """A KV key: mostly made-up ones (allowed characters, dots and odd lengths), some real."""
    if real and rng.random() < 0.2:
        return rng.choice(real)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789-_=./"
    key = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))).strip("./") or "k"
    while ".." in key:  # "..." left ".." after one replace: an empty subject token, which no stream takes
        key = key.replace("..", ".")
    return key
