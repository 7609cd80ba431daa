"""``bear.batch/1``, one executed engine step for calibration (docs/contract.md), as one typed
message: ``BatchRecord`` with its ``BatchItem``s. The sim engine, ``bear eval`` and the profiling
runs build it; the calibrator decodes it (``batch_record``: decode = validate, plus the limits a
schema cannot say); the snapshotter, which must stay stdlib-only beside vLLM, builds the same map
by hand (tests/protocol/test_batch.py ties its keys to these fields).

An item is a ``TypedDict``, not a struct: libbea's ``batch_features`` (eq. 12's terms, the fit)
reads plain maps, and ``bear eval`` builds millions of items per run — a dict costs nothing
there, and msgspec still validates each one on decode."""

from __future__ import annotations

import math
from typing import Annotated, Any, TypedDict

import msgspec
from msgspec import UNSET, Meta, UnsetType

from bear.protocol import schemas
from bear.protocol.by_name import ByName
from bear.protocol.codec import STRUCT_ENCODER

MAX_ITEMS = 8192  # requests in one step: more is no engine's batch
TokenCount = Annotated[int, Meta(ge=0, lt=2**31)]


class BatchItem(TypedDict):
    """One request in the step: ``n`` tokens computed, ``context`` its computed tokens before
    them, ``decode`` true for a generation step."""

    n: TokenCount
    context: TokenCount
    decode: bool


class BatchRecord(ByName, msgspec.Struct, tag_field="v", tag=schemas.BATCH, kw_only=True, forbid_unknown_fields=False):
    """A step. ``duration_s``: the loop period (this step's scheduling to the next's) while the
    engine stays busy, None when it went idle (no period to learn from); ``exec_s``: the model's
    execution alone (the snapshotter measures it; unset elsewhere). Field order is the wire order
    of the maps this replaced; ``r["items"]`` reads as on those maps (``ByName``)."""

    instance: str = ""
    seq: int = 0
    duration_s: Annotated[float, Meta(ge=0)] | None = None
    exec_s: float | UnsetType = UNSET
    items: Annotated[list[BatchItem], Meta(max_length=MAX_ITEMS)]

    @property
    def v(self) -> str:
        return schemas.BATCH


FIELDS: tuple[str, ...] = ("v", *BatchRecord.__struct_fields__)  # the keys of the map on the wire


def encode_batches(records: list[BatchRecord | dict[str, Any]]) -> bytes:
    """A ``bear.batches.<id>`` group: records as structs or as the snapshotter's maps, the bytes
    ``bear.protocol.codec.pack`` gave the maps (numpy numbers too, as it took them)."""
    return STRUCT_ENCODER.encode(records)


def batch_record(obj: Any) -> BatchRecord | None:
    """A decoded map (one element of a ``bear.batches.<id>`` group, a line of a batches file) as a
    ``BatchRecord``; None when it is not one — a wrong type or range, another schema id, a
    ``duration_s`` that is not finite."""
    try:
        r = msgspec.convert(obj, BatchRecord)
    except msgspec.ValidationError:
        return None
    if r.duration_s is not None and not math.isfinite(r.duration_s):
        return None
    return r
