"""The mirror of one instance's prefix cache: a multiset fed in seq order, unsynced on a gap,
another epoch or events before any state, and whole again after one (chunked) state."""

from __future__ import annotations

from bear.prefix.mirror import PrefixMirror
from bear.protocol.messages import KvEvents, KvOp, KvState


def ev(seq: int, *ops: KvOp, epoch: str = "e1") -> KvEvents:
    return KvEvents(instance="a", epoch=epoch, seq=seq, t=0.0, ops=list(ops))


def state(hashes: list[int], seq: int, epoch: str = "e1", part: int = 0, parts: int = 1) -> KvState:
    return KvState(instance="a", epoch=epoch, seq=seq, t=0.0, hashes=b"".join(h.to_bytes(8, "big") for h in hashes),
                   part=part, parts=parts)


def test_events_before_a_state_are_not_trusted() -> None:
    m = PrefixMirror("a")
    assert m.needs_resync
    assert not m.apply(ev(0, KvOp("stored", [1])))
    assert len(m) == 0
    assert m.install(state([], -1))
    assert m.apply(ev(0, KvOp("stored", [1, 2])))
    assert 1 in m and 2 in m and not m.needs_resync


def test_duplicates_count_and_removals_release_one_copy() -> None:
    m = PrefixMirror("a")
    m.install(state([], -1))
    m.apply(ev(0, KvOp("stored", [7]), KvOp("stored", [7])))
    m.apply(ev(1, KvOp("removed", [7])))
    assert 7 in m
    m.apply(ev(2, KvOp("removed", [7, 99])))
    assert 7 not in m and m.stats.unknown_removals == 1
    m.apply(ev(3, KvOp("stored", [1, 2, 3]), KvOp("cleared"), KvOp("stored", [4])))
    assert sorted(m.counts) == [4]


def test_gap_unsyncs_until_the_next_state() -> None:
    m = PrefixMirror("a")
    m.install(state([], -1))
    m.apply(ev(0, KvOp("stored", [1])))
    m.apply(ev(0, KvOp("stored", [1])))  # redelivery: ignored
    assert m.counts == {1: 1}
    assert not m.apply(ev(2, KvOp("stored", [2])))  # seq 1 missed
    assert m.needs_resync and m.stats.gaps == 1 and "missed" in (m.resync_reason or "")
    assert not m.apply(ev(3, KvOp("stored", [3])))  # still unsynced: nothing applied
    assert m.install(state([1, 2, 3], 3))
    assert m.apply(ev(4, KvOp("removed", [1])))
    assert sorted(m.counts) == [2, 3] and m.seq == 4


def test_new_epoch_unsyncs() -> None:
    m = PrefixMirror("a")
    m.install(state([5], -1))
    assert not m.apply(ev(0, KvOp("stored", [1]), epoch="e2"))
    assert m.needs_resync and "epoch" in (m.resync_reason or "")
    assert m.install(state([], -1, epoch="e2"))
    assert m.apply(ev(0, KvOp("stored", [1]), epoch="e2"))


def test_chunked_state_and_dump_round_trip() -> None:
    m = PrefixMirror("a")
    m.install(state([], -1))
    m.apply(ev(0, KvOp("stored", [1, 2, 2, 3])))
    data = m.dump()
    n = len(data) // 8
    parts = [data[: 16], data[16: 24], data[24:]]
    other = PrefixMirror("a")
    for k, p in enumerate(parts):
        done = other.install(KvState(instance="a", epoch="e1", seq=0, t=0.0, hashes=p, part=k, parts=3))
        assert done == (k == 2)
    assert other.counts == m.counts and n == 4 and other.seq == 0


def test_part_out_of_order_is_dropped() -> None:
    m = PrefixMirror("a")
    assert not m.install(state([1], 5, part=1, parts=2))
    assert m.needs_resync
    assert not m.install(state([1], 5, part=0, parts=2))
    assert not m.install(state([2], 6, part=1, parts=2))  # another state's part
    assert m.needs_resync


def test_runaway_stream_is_refused() -> None:
    m = PrefixMirror("a", max_blocks=3)
    m.install(state([], -1))
    assert not m.apply(ev(0, KvOp("stored", [1, 2, 3, 4])))
    assert m.needs_resync and m.stats.overflows == 1
