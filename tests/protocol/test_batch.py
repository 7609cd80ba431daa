"""bear.batch/1 as a struct (bear.protocol.batch, issue 25): the bytes of the maps its producers
built before, decode = validate with the calibrator's limits, and the files of older records."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import get_type_hints

import msgpack
import numpy as np
import pytest

from bear.calibrator.fit import read_records
from bear.calibrator.service import valid_record
from bear.protocol import schemas
from bear.protocol.batch import FIELDS, MAX_ITEMS, BatchItem, BatchRecord, batch_record, encode_batches
from bear.protocol.codec import pack
from bear.protocol.messages import encode

ITEMS = [{"n": 384, "context": 0, "decode": False}, {"n": 1, "context": 500, "decode": True}]
GOOD = {"v": schemas.BATCH, "instance": "i1", "seq": 7, "duration_s": 0.0123, "items": ITEMS}


def test_fields_and_wire_order() -> None:
    assert FIELDS == ("v", "instance", "seq", "duration_s", "exec_s", "items")
    assert tuple(get_type_hints(BatchItem)) == ("n", "context", "decode")


@pytest.mark.parametrize("duration", [0.0123, None])
def test_a_record_is_the_bytes_of_the_map_eval_and_profiling_built(duration: float | None) -> None:
    old = {**GOOD, "duration_s": duration}  # bear eval's and the profiling runs' map, in its key order
    rec = BatchRecord(instance="i1", seq=7, duration_s=duration, items=ITEMS)
    assert encode(rec) == pack(old) == msgpack.packb(old, use_bin_type=True)
    assert encode([rec, rec]) == pack([old, old])  # a bear.batches.<id> group
    back = batch_record(msgpack.unpackb(encode(rec)))
    assert back == rec and back["items"] == ITEMS and back.get("v") == schemas.BATCH


def test_a_group_is_the_bytes_pack_gave_numpy_numbers_included() -> None:
    snapshotter = {"v": schemas.BATCH, "instance": "i1", "seq": 8, "duration_s": None, "exec_s": 0.002,
                   "items": ITEMS}
    sim = BatchRecord(instance="i1", seq=np.int64(7), duration_s=np.float64(0.0123), items=ITEMS)
    assert encode_batches([sim, snapshotter]) == pack([GOOD, snapshotter])


def test_exec_s_is_written_only_when_measured() -> None:
    rec = BatchRecord(instance="i1", seq=7, duration_s=None, exec_s=0.004, items=ITEMS)
    want = {"v": schemas.BATCH, "instance": "i1", "seq": 7, "duration_s": None, "exec_s": 0.004, "items": ITEMS}
    assert encode(rec) == pack(want)
    assert "exec_s" not in msgpack.unpackb(encode(BatchRecord(items=ITEMS)))


def _with(**kw: object) -> dict:
    return {**GOOD, **kw}


def _item(**kw: object) -> dict:
    return _with(items=[{**ITEMS[0], **kw}])


BAD = {
    "not a map": [GOOD],
    "items missing": {k: v for k, v in GOOD.items() if k != "items"},
    "items not a list": _with(items={"n": 1}),
    "an item not a map": _with(items=[1]),
    "n a bool": _item(n=True),
    "n negative": _item(n=-1),
    "n too large": _item(n=2**31),
    "context a float": _item(context=1.5),
    "context missing": _with(items=[{"n": 1, "decode": True}]),
    "decode an int": _item(decode=1),
    "too many items": _with(items=[ITEMS[1]] * (MAX_ITEMS + 1)),
    "duration negative": _with(duration_s=-0.1),
    "duration nan": _with(duration_s=math.nan),
    "duration inf": _with(duration_s=math.inf),
    "duration a bool": _with(duration_s=True),
    "duration a string": _with(duration_s="0.1"),
    "another schema": _with(v=schemas.SNAPSHOT),
}
OK = {
    "as sent": GOOD,
    "idle (null duration)": _with(duration_s=None),
    "an int duration": _with(duration_s=1),
    "no v (the fit's own records)": {"items": ITEMS, "duration_s": 0.5},
    "the snapshotter's older key": {"schema": schemas.BATCH, **{k: v for k, v in GOOD.items() if k != "v"}},
    "empty items": _with(items=[]),
    "as many items as allowed": _with(items=[ITEMS[1]] * MAX_ITEMS),
    "an item with more fields": _with(items=[{**ITEMS[0], "extra": "x" * 100}]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_records_are_refused(name: str) -> None:
    assert batch_record(BAD[name]) is None and not valid_record(BAD[name])


@pytest.mark.parametrize("name", list(OK))
def test_records_the_calibrator_accepts(name: str) -> None:
    r = batch_record(OK[name])
    assert r is not None and valid_record(OK[name])
    assert all(set(it) == {"n", "context", "decode"} for it in r.items)  # only what the fit reads is kept


def test_batch_files_decode_and_a_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "batches.jsonl.gz"
    lines = [OK["the snapshotter's older key"], GOOD]
    path.write_bytes(gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode()))
    got = list(read_records([path]))
    assert [r.seq for r in got] == [7, 7] and all(isinstance(r, BatchRecord) for r in got)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps(BAD["n negative"]) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        list(read_records([bad]))
