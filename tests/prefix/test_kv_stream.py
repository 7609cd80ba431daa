"""The instance publisher's prefix-cache stream without NATS (a fake connection): the epoch
opens with its state, events follow in seq order, a full queue or an outage drops messages
(seq still advances, so mirrors see the gap), large states go out in parts a mirror reassembles,
and a resync request is answered with one state."""

from __future__ import annotations

from typing import Any

from bear.instance.kv_stream import KvStream
from bear.prefix.mirror import PrefixMirror
from bear.protocol.messages import KvMessage, KvOp, KvResync, decode, encode
from bear.protocol.subjects import Subjects


class FakeNats:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.subs: dict[str, Any] = {}
        self.is_connected = True

    async def publish(self, subject: str, data: bytes) -> None:
        self.sent.append((subject, data))

    async def subscribe(self, subject: str, cb: Any) -> Any:
        self.subs[subject] = cb
        return object()


def feed(mirror: PrefixMirror, nc: FakeNats) -> None:
    for _, data in nc.sent:
        mirror.offer(decode(KvMessage, data))  # type: ignore[arg-type]
    nc.sent.clear()


async def test_state_then_events_keep_a_listener_synced() -> None:
    nc, kv, m = FakeNats(), KvStream("a", Subjects()), PrefixMirror("a")
    kv.events([KvOp("stored", [1, 2])])
    await kv.subscribe(nc)
    await kv.publish(nc)
    # the queued events go first, then the opening state (taken after them): nothing is lost
    feed(m, nc)
    assert m.synced and m.counts == {1: 1, 2: 1} and m.seq == 0
    kv.events([KvOp("removed", [1]), KvOp("stored", [3])])
    await kv.publish(nc)
    feed(m, nc)
    assert m.counts == {2: 1, 3: 1} and m.seq == 1


async def test_overflow_and_outage_leave_a_gap_then_a_state_heals_it() -> None:
    nc, kv, m = FakeNats(), KvStream("a", Subjects(), buffer=2, min_state_interval_s=0.0), PrefixMirror("a")
    await kv.publish(nc)
    feed(m, nc)
    for h in range(5):  # 5 messages into a queue of 2: the 3 oldest dropped
        kv.events([KvOp("stored", [h])])
    assert kv.dropped == 3
    kv.request_state()
    await kv.publish(nc)
    msgs = [decode(KvMessage, d) for _, d in nc.sent]  # type: ignore[arg-type]
    assert [getattr(x, "seq", None) for x in msgs] == [3, 4, 4]  # events 3, 4, then the state after 4
    feed(m, nc)
    assert m.synced and sorted(m.counts) == [0, 1, 2, 3, 4]
    nc.is_connected = False
    kv.events([KvOp("stored", [9])])
    kv.disconnected()
    assert kv.pending == 0
    kv.events([KvOp("stored", [10])])
    await kv.publish(nc)  # back: seq 6 arrives, seq 5 never did; the wanted state follows it
    m2 = PrefixMirror("a")
    m2.install(decode(KvMessage, nc.sent[-1][1]))  # type: ignore[arg-type]
    assert 9 in m2 and 10 in m2 and m2.seq == 6


async def test_big_state_in_parts_and_resync_answered() -> None:
    nc, kv = FakeNats(), KvStream("a", Subjects(), state_chunk=3, min_state_interval_s=0.0)
    await kv.subscribe(nc)
    kv.events([KvOp("stored", list(range(10)))])
    await kv.publish(nc)
    nc.sent.clear()
    await nc.subs[Subjects().kv_resync("a")](type("Msg", (), {"data": encode(KvResync(instance="a"))})())
    await kv.publish(nc)
    parts = [decode(KvMessage, d) for _, d in nc.sent]  # type: ignore[arg-type]
    assert [p.part for p in parts] == [0, 1, 2, 3] and {p.parts for p in parts} == {4} and kv.resyncs == 1
    m = PrefixMirror("a")
    for p in parts:
        m.offer(p)
    assert m.synced and sorted(m.counts) == list(range(10))
