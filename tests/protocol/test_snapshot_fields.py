"""The fields libbea's bear.snapshot/1 parser reads (libbea/core/src) are the fields of the
Python structs that describe the schema (bear.protocol.snapshot), and what the Python snapshotter
writes is such a snapshot (issue 25)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from bear.protocol import schemas
from bear.protocol.snapshot import Inflight, InflightItem, Snapshot, SnapshotConfig, SnapshotRequest
from bear.snapshotter.records import ROW_FIELDS, to_snapshot

SRC = Path(__file__).resolve().parents[2] / "libbea" / "core" / "src"
READ = r"(?:int_field|opt_int|opt_bool|opt_str|opt_double|opt_index_list|opt_key_list|require)"


def _body(text: str, signature: str) -> str:
    """The body of the C++ function that starts with ``signature`` (up to its closing brace at
    column 0)."""
    start = text.index(signature)
    return text[start:text.index("\n}\n", start)]


def _reads(body: str, var: str) -> set[str]:
    """The fields a parser body reads from the map ``var`` (``id_field`` reads ``id``)."""
    v = re.escape(var)
    names = set(re.findall(rf'{READ}\({v}, "(\w+)"', body)) | set(re.findall(rf'\b{v}\.get\("(\w+)"\)', body))
    if re.search(rf"id_field\({v},", body):
        names.add("id")
    return names


def _fields(kind: type) -> set[str]:
    return set(kind.__struct_fields__)


def test_config_fields() -> None:
    src = (SRC / "snapshot.cpp").read_text(encoding="utf-8")
    assert _reads(_body(src, "Config config_from("), "c") == _fields(SnapshotConfig)


def test_request_fields() -> None:
    src = (SRC / "request_fields.cpp").read_text(encoding="utf-8")
    assert _reads(_body(src, "Request request_from_value("), "r") == _fields(SnapshotRequest)


def test_snapshot_and_inflight_fields() -> None:
    src = (SRC / "snapshot.cpp").read_text(encoding="utf-8")
    top = _body(src, "Snapshot snapshot_from_value(") + _body(src, "void tracked_from(")
    assert _reads(top, "v") == _fields(Snapshot)
    assert _reads(top, "*inf") == _fields(Inflight)
    assert _reads(top, "it") == _fields(InflightItem)


def test_the_snapshotter_writes_such_snapshots() -> None:
    config = {"max_num_batched_tokens": 2048, "max_num_scheduled_tokens": 2048, "max_num_seqs": 64,
              "long_prefill_token_threshold": 0, "enable_chunked_prefill": True, "policy": "fcfs",
              "block_size": 16, "num_gpu_blocks": 1000, "watermark_blocks": 10, "max_model_len": 4096,
              "scheduler_reserve_full_isl": True, "enable_prefix_caching": False, "async_scheduling": False}
    row = dict(zip(ROW_FIELDS, ["r1", 100, 100, 3, 64, 7, 7, 0, 12.5, 0], strict=True))
    step = {"seq": 4, "wall": 13.0, "free_blocks": 993, "running": [[row[f] for f in ROW_FIELDS]], "waiting": [],
            "inflight": (13.0, ["r1"], [1], [], ["r1"], [103])}
    snap = msgspec.convert(to_snapshot(step, config, instance="i1", model="m"), Snapshot, strict=True)
    assert snap.schema == schemas.SNAPSHOT and snap.running[0].id == "r1" and snap.inflight is not None
    assert set(ROW_FIELDS) <= _fields(SnapshotRequest)
