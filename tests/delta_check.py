"""The delta mirror against the full snapshots of the same states: shared by the tests that collect
an instance's ``bear.delta.<id>`` and ``bear.snapshot.<id>`` streams (published with
``full_every=1``, so that every state also goes out in full)."""

from __future__ import annotations

from typing import Any

from bear import libbea
from bear.protocol.codec import unpack_map


def check_mirror(fulls: list[bytes], deltas: list[bytes], final: bytes | None = None) -> dict[str, Any]:
    """Apply the deltas in arrival order in libbea, starting from the full snapshot of the state the
    first one applies to (again after a chain break: a new engine generation), and compare the
    mirror with the full snapshot of every state it reaches. Returns counts and the first
    differences (empty when the mirror equals the full state at every step); with ``final`` (a full
    snapshot of the newest state, e.g. a resync answer), the mirror at the end is compared with it
    too, capture time aside (an idle re-send refreshes it)."""
    by_state: dict[tuple[int, int, float], bytes] = {}  # (generation, seq, time) names one state
    for raw in fulls:
        m = unpack_map(raw)
        by_state[(int(m.get("generation", 0)), int(m["seq"]), float(m["time"]))] = raw
    mirror: Any = None
    out: dict[str, Any] = {"deltas": len(deltas), "applied": 0, "compared": 0, "restarts": 0, "unchained": 0,
                           "delta_bytes": sum(map(len, deltas)), "differences": []}
    for raw in deltas:
        d = libbea.Delta.from_msgpack(raw)
        if mirror is None or (mirror.generation, mirror.seq, mirror.time) != (d.generation, d.base, d.base_time):
            base = by_state.get((d.generation, d.base, d.base_time))
            if base is None:
                out["unchained"] += 1
                out.setdefault("unchained_at", []).append(
                    {"generation": d.generation, "base": d.base, "seq": d.seq,
                     "known_seqs_of_generation": sorted(k[1] for k in by_state if k[0] == d.generation)[:3]})
                mirror = None
                continue
            out["restarts"] += mirror is not None
            mirror = libbea.Snapshot.from_msgpack(base)
        mirror.apply_delta(d)
        out["applied"] += 1
        truth = by_state.get((d.generation, d.seq, d.time))
        if truth is not None:
            out["compared"] += 1
            diff = libbea.snapshot_difference(mirror, libbea.Snapshot.from_msgpack(truth))
            if diff is not None and len(out["differences"]) < 10:
                out["differences"].append(f"seq {d.seq}: {diff}")
    if final is not None:
        truth = libbea.Snapshot.from_msgpack(final)
        if mirror is None or (mirror.generation, mirror.seq) != (truth.generation, truth.seq):
            out["differences"].append(f"final: the mirror is not at seq {truth.seq}")
        elif (diff := libbea.snapshot_difference(mirror, truth, compare_time=False)) is not None:
            out["differences"].append(f"final seq {truth.seq}: {diff}")
    return out
