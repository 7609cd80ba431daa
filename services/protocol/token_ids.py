"""A prompt's token ids on the wire: packed as little-endian uint32 (one msgpack ``bin`` field),
so that 8k ids cost one memcpy to encode and to decode instead of 8k msgpack ints. The old form,
a list of ints, is still accepted; both read back as a ``Sequence[int]`` (a ``memoryview`` over
the packed bytes: no copy, and libbea's block hasher reads it in place)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Literal

LITTLE = sys.byteorder == "little"
U32: Literal["I", "L"] = "I" if array("I").itemsize == 4 else "L"  # the array/memoryview code of a uint32


def pack(ids: Iterable[int]) -> bytes:
    """Token ids (each in 0 … 2^32 − 1) as little-endian uint32 bytes; OverflowError otherwise."""
    a = array(U32, ids)
    if not LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack(data: bytes | Sequence[int]) -> Sequence[int]:
    """The ids of either wire form (packed bytes: ValueError when the length is not a multiple
    of 4)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        return data
    if len(data) % 4:
        raise ValueError(f"packed token ids: {len(data)} bytes is not a multiple of 4")
    if LITTLE:
        return memoryview(data).cast("B").cast(U32)
    a = array(U32, bytes(data))
    a.byteswap()
    return a


def count(data: bytes | Sequence[int]) -> int:
    """How many ids either wire form holds."""
    return len(data) // 4 if isinstance(data, bytes | bytearray | memoryview) else len(data)
