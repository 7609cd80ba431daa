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


def check_plugin_deltas(raws: list[Any], config: dict[str, Any], generation: int = 7) -> dict[str, Any]:
    """The vLLM plugin's raw records of one engine generation, decoded as the snapshotter decodes
    them: every step whose record carried a delta that applied has its ``bear.delta/1`` forwarded
    from the decoder's change (no diff of two states); that delta, applied by libbea to the
    previous step's full snapshot, must give exactly the step's full snapshot — and must be the
    delta ``encode_delta`` computes from the two states. Returns counts and the first differences."""
    from bear.instance.delta import encode_delta, forward_delta
    from bear.protocol.codec import pack
    from bear.snapshotter.records import to_snapshot
    from bear.snapshotter.step_decoder import StepDecoder

    dec = StepDecoder()
    prev: dict[str, Any] | None = None
    out: dict[str, Any] = {"steps": 0, "forwarded": 0, "applied_equal": 0, "same_as_diff": 0, "differences": []}
    for raw in raws:
        step = dec.decode(raw)
        if step is None:
            out["differences"].append(f"seq {raw[1]}: undecodable ({dec.last_problem})")
            prev = None
            continue
        out["steps"] += 1
        snap = dict(to_snapshot(step, config, instance="i", model="m"), generation=generation, v="bear.snapshot/1")
        change = dec.change
        if prev is not None and change is not None:
            d = forward_delta(prev, snap, change)
            if d is None:
                out["differences"].append(f"seq {step['seq']}: a change that was not forwarded")
            else:
                out["forwarded"] += 1
                out["same_as_diff"] += d == encode_delta(prev, snap)
                held = libbea.Snapshot.from_msgpack(pack(prev))
                held.apply_delta(libbea.Delta.from_msgpack(pack(d)))
                diff = libbea.snapshot_difference(held, libbea.Snapshot.from_msgpack(pack(snap)))
                if diff is None:
                    out["applied_equal"] += 1
                elif len(out["differences"]) < 10:
                    out["differences"].append(f"seq {step['seq']}: {diff}")
        prev = snap
    out["decoder"] = dict(dec.stats)
    return out
