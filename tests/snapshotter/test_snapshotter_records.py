"""Raw plugin records → bear.snapshot/1, bear.batch/1, and `bear record` replay cases."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import get_type_hints

from bear import libbea
from bear.protocol import schemas
from bear.protocol.batch import FIELDS, BatchItem, batch_record
from bear.protocol.codec import pack
from bear.protocol.messages import encode
from bear.replay.recorded_run import build_cases, record_run
from bear.snapshotter.records import BatchBuilder, batches_of, parse_step, to_snapshot

from snapshotter_fakes import CONFIG, meta, raw_step


def _scenario() -> list[dict]:
    """Two requests on a budget of 384 tokens: A (500-token prompt, 3 outputs) arrives first,
    B (100 tokens, 2 outputs) arrives while A's first chunk runs."""
    t = 100.0
    A = {"id": "A", "prompt": 500, "max_tokens": 3, "arrival": 1.0}
    B = {"id": "B", "prompt": 100, "max_tokens": 2, "arrival": 2.0}
    raws = [
        raw_step(0, busy=False, t0=t),
        raw_step(1, sched={"A": 384}, new={"A": 0}, running=[{**A, "computed": 384, "blocks": 3}],
                 waiting=[{**B, "computed": 0, "blocks": 0}], t0=t + 1),
        raw_step(2, sched={"A": 116, "B": 100}, new={"B": 0}, cached={"A": 384},
                 running=[{**A, "computed": 500, "output": 1, "blocks": 4}, {**B, "computed": 100, "output": 1}],
                 t0=t + 1.01),
        raw_step(3, sched={"A": 1, "B": 1}, cached={"A": 500, "B": 100},
                 running=[{**A, "computed": 501, "output": 2, "blocks": 4}], t0=t + 1.02),
        raw_step(4, sched={"A": 1}, cached={"A": 501}, busy=False, t0=t + 1.03),
    ]  # fmt: skip
    return [parse_step(r) for r in raws]


def test_snapshot_has_the_schema_fields_of_the_public_traces(cases: list[dict]) -> None:
    steps = _scenario()
    snap = to_snapshot(steps[1], CONFIG, instance="i1", model="m")
    public = cases[1]["snapshot"]
    assert set(public) - {"model"} <= set(snap)
    assert set(public["config"]) <= set(snap["config"])
    assert set(snap["running"][0]) == set(public["running"][0])
    assert snap["running"][0]["exclusive_blocks"] == 3 and snap["waiting"][0]["id"] == "B"
    libbea.Snapshot.from_dict(snap)  # the replay core accepts it


def test_batch_records_durations_and_decode_flags() -> None:
    steps = _scenario()
    recs = batches_of(steps, "i1")
    assert [r["seq"] for r in recs] == [1, 2, 3, 4]
    assert recs[0]["items"] == [{"n": 384, "context": 0, "decode": False}]
    assert recs[1]["items"] == [
        {"n": 116, "context": 384, "decode": False},
        {"n": 100, "context": 0, "decode": False},
    ]
    assert recs[2]["items"] == [
        {"n": 1, "context": 500, "decode": True},
        {"n": 1, "context": 100, "decode": True},
    ]
    assert abs(recs[0]["duration_s"] - 0.01) < 1e-9
    assert recs[3]["duration_s"] is None  # engine went idle after step 4
    prompts = [[500], [500, 100], [500, 100], [500]]
    for r, ps in zip(recs, prompts, strict=True):
        for it, p in zip(r["items"], ps, strict=True):
            assert it["decode"] == libbea.is_decode(it["n"], it["context"], p)


def test_batch_records_are_the_protocols_struct() -> None:
    """records.py builds bear.batch/1 by hand (stdlib only beside vLLM): its keys, in order, are
    BatchRecord's fields, each item's BatchItem's, and the struct encodes to the same bytes."""
    recs = batches_of(_scenario(), "i1")
    assert recs
    for r in recs:
        assert tuple(r) == FIELDS and r["v"] == schemas.BATCH
        assert all(tuple(it) == tuple(get_type_hints(BatchItem)) for it in r["items"])
        typed = batch_record(r)
        assert typed is not None and encode(typed) == pack(r)


def test_batch_record_is_held_until_the_next_step_starts() -> None:
    steps = _scenario()
    b = BatchBuilder("i1")
    assert b.feed(steps[0]) == []
    assert b.feed(steps[1]) == []  # busy: waits for step 2's start
    out = b.feed(steps[2])
    assert [r["seq"] for r in out] == [1]


def test_cases_replay_exactly_with_libbea() -> None:
    steps = _scenario()
    cs = build_cases(meta(), steps, trace="t")
    by_id = {c["request"]["id"]: c for c in cs}
    assert set(by_id) == {"A", "B"}
    a, b = by_id["A"], by_id["B"]
    assert a["snapshot"]["seq"] == 0 and a["expected_batches"] == [{"A": 384}, {"A": 116}]
    # B reached the scheduler in the same gap as A, behind it: same snapshot, A queued ahead of B
    assert b["snapshot"]["seq"] == 0 and [r["id"] for r in b["snapshot"]["waiting"]] == ["A"]
    assert b["expected_batches"] == [{"A": 384}, {"A": 116, "B": 100}]
    assert b["output_lengths"] == {"A": 3, "B": 2}
    assert abs(b["engine_ttft_s"] - (0.01 + 0.01 * 0.95)) < 1e-9
    for c in cs:
        s = libbea.Snapshot.from_dict(c["snapshot"])
        res = libbea.estimate(s, c["request"], beta=[0.01, 0, 0, 0], lengths=c["output_lengths"], trace=True)
        assert res["batches"] == c["expected_batches"], c["request"]["id"]


def test_a_chunk_capped_because_of_a_later_arrival_is_flagged() -> None:
    """vLLM caps a prefill chunk at --long-prefill-token-threshold only while more than one
    request runs or waits: A alone takes the whole 384-token budget; once B (which arrived after
    A) waits, A's next chunk is capped at 200. No replay from the state before A knows of B, so
    A's case is flagged; B's (with A in its snapshot) is not, and replays exactly."""
    t = 100.0
    A = {"id": "A", "prompt": 700, "max_tokens": 2, "arrival": 1.0}
    B = {"id": "B", "prompt": 100, "max_tokens": 2, "arrival": 2.0}
    raws = [
        raw_step(0, busy=False, t0=t),
        raw_step(1, sched={"A": 384}, new={"A": 0}, running=[{**A, "computed": 384, "blocks": 3}], t0=t + 1),
        raw_step(2, sched={"A": 200, "B": 100}, new={"B": 0}, cached={"A": 384},
                 running=[{**A, "computed": 584, "blocks": 5}, {**B, "computed": 100, "output": 1}], t0=t + 1.01),
        raw_step(3, sched={"A": 116, "B": 1}, cached={"A": 584, "B": 100},
                 running=[{**A, "computed": 700, "output": 1, "blocks": 6}], t0=t + 1.02),
        raw_step(4, sched={"A": 1}, cached={"A": 700}, busy=False, t0=t + 1.03),
    ]  # fmt: skip
    m = meta()
    m["config"] = {**m["config"], "long_prefill_token_threshold": 200}
    cs = {c["request"]["id"]: c for c in build_cases(m, [parse_step(r) for r in raws], trace="t")}
    a, b = cs["A"], cs["B"]
    assert a["expected_batches"] == [{"A": 384}, {"A": 200}, {"A": 116}]
    assert a["cap_by_later_arrival"] is True and b["cap_by_later_arrival"] is False
    replay = libbea.estimate(libbea.Snapshot.from_dict(a["snapshot"]), a["request"], beta=[0.01, 0, 0, 0],
                             lengths=a["output_lengths"], trace=True)
    assert replay["batches"] == [{"A": 384}, {"A": 316}]  # alone all the way: what it could know
    assert all(not c["cap_by_later_arrival"] for c in build_cases(meta(), _scenario(), trace="t"))


def test_record_run_writes_the_public_file_layout(tmp_path: Path, cases: list[dict]) -> None:
    steps = _scenario()
    log = tmp_path / "run.jsonl.gz"
    with gzip.open(log, "wt") as f:
        f.write(json.dumps({"meta": meta(), "step": steps[0]}) + "\n")
        for s in steps[1:]:
            f.write(json.dumps(s) + "\n")
    cpath, bpath, nc, nb = record_run([log], trace="mine", out_dir=tmp_path / "out")
    assert (nc, nb) == (2, 4) and bpath.name == "batches_mine.jsonl.gz"
    with gzip.open(cpath, "rt") as f:
        first = json.loads(f.readline())
    assert set(first) - {"cap_by_later_arrival"} == set(cases[0])  # the public layout, plus that flag
    assert set(first["request"]) == set(cases[0]["request"])


def test_bear_record_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from bear.cli import app

    log = tmp_path / "run.jsonl"
    steps = _scenario()
    log.write_text(
        "\n".join([json.dumps({"meta": meta(), "step": steps[0]}), *(json.dumps(s) for s in steps[1:])])
    )
    res = CliRunner().invoke(app, ["record", str(log), "--trace", "cli", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "2 cases" in res.output and (tmp_path / "o" / "batches_cli.jsonl.gz").exists()
    assert CliRunner().invoke(app, ["snapshotter", "--help"]).exit_code == 0


# ---- per-step deltas (step_decoder: StepDecoder / EngineState) ---------------------------------------------------
def _delta_scenario() -> tuple[list[tuple], list[tuple]]:
    """The same four steps as full records (what the plugin writes with deltas off) and as the
    plugin's deltas. A (500-token prompt, 3 outputs) and B (100, 2 outputs) arrive before step 1;
    A takes the whole budget (384); step 2 finishes A's prompt and admits B; C (300 tokens, its
    first 256 a prefix-cache hit on A's blocks 1 and 2) arrives before step 3; B stops in step 3,
    A in step 4. Block ids: A 1-4, B 5, C shares 1, 2 and gets 6."""
    from snapshotter_fakes import delta, delta_step

    t = 100.0
    A = {"id": "A", "prompt": 500, "max_tokens": 3, "arrival": 1.0}
    B = {"id": "B", "prompt": 100, "max_tokens": 2, "arrival": 2.0}
    C = {"id": "C", "prompt": 300, "max_tokens": 5, "arrival": 3.0}
    full = [
        raw_step(0, busy=False, t0=t, free=999, reason=1, with_ids=True),
        raw_step(1, sched={"A": 384}, new={"A": 0}, running=[{**A, "computed": 384, "blocks": 3, "bids": (1, 2, 3)}],
                 waiting=[{**B, "computed": 0, "blocks": 0}], t0=t + 1, free=996, with_ids=True, reason=4),
        raw_step(2, sched={"A": 116, "B": 100}, new={"B": 0}, cached={"A": 384},
                 running=[{**A, "computed": 500, "output": 1, "blocks": 4, "bids": (1, 2, 3, 4)},
                          {**B, "computed": 100, "output": 1, "bids": (5,)}], t0=t + 1.01, free=994, with_ids=True,
                 reason=4),
        raw_step(3, sched={"A": 1, "B": 1, "C": 44}, new={"C": 256}, cached={"A": 500, "B": 100},
                 running=[{**A, "computed": 501, "output": 2, "blocks": 4, "bids": (1, 2, 3, 4)},
                          {**C, "computed": 300, "output": 1, "blocks": 3, "bids": (1, 2, 6)}],
                 t0=t + 1.02, free=994, with_ids=True, reason=4),
        raw_step(4, sched={"A": 1, "C": 1}, cached={"A": 501, "C": 300},
                 running=[{**C, "computed": 301, "output": 2, "blocks": 3, "bids": (1, 2, 6)}],
                 t0=t + 1.03, free=996, with_ids=True, reason=4),
    ]  # fmt: skip
    # shared leading blocks (vLLM's ref_cnt > 1): A and C share blocks 1, 2 in steps 3 (both running)
    run3 = full[3][15]
    full[3] = (*full[3][:15], (run3[0], run3[1], run3[2], {0: 2, 1: 2}, run3[4]), *full[3][16:])
    deltas = [
        full[0],
        delta_step(1, delta(arrivals=[A, B], admitted=(("A", 0, (1, 2, 3)),), sched=1, ns=(384,), n_run=1,
                            n_wait=1), new={"A": 0}, free=996, t0=t + 1),
        delta_step(2, delta(admitted=(("B", 0, (5,)),), sched=2, ns=(116, 100), new_blocks=(1, (0,), ((4,),)),
                            emitted=2, n_run=2), new={"B": 0}, free=994, t0=t + 1.01),
        delta_step(3, delta(arrivals=[C], admitted=(("C", 256, (1, 2, 6)),), sched=3, ns=(1, 1, 44), new_blocks=2,
                            fin_upd=("B",), emitted=3, n_run=2), new={"C": 256}, free=994, t0=t + 1.02),
        delta_step(4, delta(sched=2, new_blocks=2, fin_upd=("A",), emitted=2, n_run=1), free=996, t0=t + 1.03),
    ]  # fmt: skip
    return full, deltas


def _published(step: dict) -> dict:
    return {k: step[k] for k in ("running", "waiting", "sched", "new_reqs", "cached_computed", "free_blocks")}


def test_deltas_decode_to_the_full_state() -> None:
    from bear.snapshotter.step_decoder import StepDecoder

    full, deltas = _delta_scenario()
    dec = StepDecoder()
    got = [dec.decode(r) for r in deltas]
    want = [parse_step(r) for r in full]
    for g, w in zip(got, want, strict=True):
        assert g is not None and _published(g) == _published(w), (g["seq"], _published(g), _published(w))
    assert got[3]["running"][0][6] == 2 and got[3]["running"][1][6] == 1  # shared prefix: A 4-2, C 3-2
    assert got[4]["running"][0][6] == 3  # A gone: C's blocks are its own again
    assert [g["record"] for g in got] == ["first", "delta", "delta", "delta", "delta"]
    assert dec.stats == {"full": 1, "delta": 4, "verified": 0, "mismatches": 0, "undecodable": 0, "gaps": 0}
    # the batch records are the same whichever way the steps were decoded
    assert batches_of(got, "i") == batches_of(want, "i")


def test_verify_records_compare_the_mirror_with_the_full_state() -> None:
    from bear.snapshotter.step_decoder import StepDecoder

    full, deltas = _delta_scenario()
    both = [full[0]] + [(*f[:20], 6, d[21], None) for f, d in zip(full[1:], deltas[1:], strict=True)]
    dec = StepDecoder()
    for r in both:
        assert dec.decode(r) is not None and dec.last_problem is None
    assert dec.stats["verified"] == 4 and dec.stats["mismatches"] == 0
    # a wrong delta (B's output not counted) is caught; the full record resynchronises
    bad = list(both[3][21])
    bad[9] = 2
    dec = StepDecoder()
    for r in both[:3]:
        dec.decode(r)
    step = dec.decode((*both[3][:21], tuple(bad), None))
    assert step is not None and step["running"] == parse_step(full[3])["running"]  # the full state wins
    assert dec.stats["mismatches"] == 1 and "got output" in (dec.last_problem or "")
    assert dec.decode(both[4]) is not None and dec.last_problem is None


def test_delta_without_state_or_after_a_gap_is_not_decoded() -> None:
    from bear.snapshotter.step_decoder import StepDecoder

    full, deltas = _delta_scenario()
    dec = StepDecoder()
    assert dec.decode(deltas[1]) is None and dec.stats["undecodable"] == 1  # no full record yet
    dec.decode(full[1])
    assert dec.decode(deltas[3]) is None  # step 2 is missing: never guess
    assert dec.stats["gaps"] == 1 and dec.stats["mismatches"] == 0 and dec.stats["undecodable"] == 2
    assert dec.decode(deltas[4]) is None and dec.stats["undecodable"] == 3  # until the next full record
    dec.decode(full[3])
    assert _published(dec.decode(deltas[4]) or {}) == _published(parse_step(full[4]))
    # a wrong count of blocks in use is caught on the delta itself
    dec = StepDecoder()
    dec.decode(full[0])
    d1 = deltas[1]
    assert dec.decode((*d1[:14], 990, *d1[15:])) is None and "blocks held" in (dec.last_problem or "")


def test_the_plugin_delta_is_forwarded_and_libbea_makes_the_full_state_of() -> None:
    """The decoder's bear.delta/1 of each delta record, forwarded as the publisher forwards it,
    applied by libbea to the previous step's full snapshot, is that step's full snapshot — and the
    delta is the one encode_delta computes from the two states."""
    from delta_check import check_plugin_deltas

    full, deltas = _delta_scenario()
    res = check_plugin_deltas(deltas, CONFIG)
    assert res["differences"] == [] and res["forwarded"] == res["applied_equal"] == res["same_as_diff"] == 4, res
    # a verify stream (every record: delta and full state) gives the same
    both = [full[0]] + [(*f[:20], 6, d[21], None) for f, d in zip(full[1:], deltas[1:], strict=True)]
    res = check_plugin_deltas(both, CONFIG)
    assert res["differences"] == [] and res["forwarded"] == res["applied_equal"] == 4, res


def test_real_vllm_plugin_deltas_applied_by_libbea_equal_the_full_snapshots() -> None:
    """600 steps of vLLM's real scheduler (tests/data/plugin-records: KV pressure, preemptions,
    prefix hits, aborts, resets), each record with the delta and the full state: every forwarded
    delta gives, in libbea, exactly the full snapshot of its step."""
    import marshal

    from delta_check import check_plugin_deltas

    path = Path(__file__).parents[1] / "data" / "plugin-records" / "kv-pressure-prefix.marshal.gz"
    with gzip.open(path, "rb") as f:
        meta_, raws = marshal.load(f)
    res = check_plugin_deltas(raws, meta_["config"])
    kinds = [r[20] for r in raws]
    assert res["differences"] == [] and res["decoder"]["mismatches"] == 0, res
    # every record but the first and the plugin's own full ones (queues reordered behind its back)
    assert res["forwarded"] == res["applied_equal"] == len(raws) - 1 - kinds.count(4) > 500, res
    assert sum(len(r[13]) for r in raws) > 0  # preemptions among them
