"""Issue 40, item 1, without NATS: the client library checks ``Chunk.seq``. ``ChunkOrder`` gives
the chunks in order, holds early ones and names a gap; ``submit()`` never ends ``done`` with a
chunk missing — it asks for the gap (``bear.resend/1`` on ``bear.cancel``) and ends whole, or in
the coded ``incomplete`` error saying what was lost. The NATS connection here is a stand-in that
plays a router's messages into the submission's inbox and records what the client publishes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from bear.client import submit as client
from bear.client.submit import ChunkOrder, submit
from bear.protocol.errors import ErrorCode
from bear.protocol.replies import Chunk, Done, Error, Reply, Routed, encode_reply
from bear.protocol.subjects import Subjects
from bear.protocol.submit import MAX_RESEND_RANGES, decode_resend

from waiting import HANG_S

S = Subjects()


def _c(seq: int) -> Chunk:
    return Chunk(seq=seq, text=f"t{seq} ")


def test_in_order_chunks_pass_through() -> None:
    o = ChunkOrder()
    assert [c.seq for k in range(5) for c in o.add(_c(k))] == [0, 1, 2, 3, 4]
    o.end(5)
    assert o.whole and not o.gapped and o.missing() == []


def test_a_gap_is_held_named_and_filled_in_order() -> None:
    o = ChunkOrder()
    got = [c.seq for k in (0, 1, 4, 5, 7) for c in o.add(_c(k))]
    assert got == [0, 1] and not o.whole and o.gapped
    assert o.missing() == [(2, 4), (6, 7)]
    o.end(10)  # the done: 10 chunks, so 8 and 9 are missing too
    assert o.missing() == [(2, 4), (6, 7), (8, 10)] and o.lost() == 5
    assert "5 chunk(s) of 10 lost" in o.describe() and "seq 2–3, 6, 8–9" in o.describe()
    assert [c.seq for c in o.add(_c(3))] == [] and [c.seq for c in o.add(_c(2))] == [2, 3, 4, 5]
    assert [c.seq for k in (6, 8, 9) for c in o.add(_c(k))] == [6, 7, 8, 9]
    assert o.whole and o.filled == 5


def test_duplicates_and_chunks_past_the_end_are_dropped() -> None:
    o = ChunkOrder()
    o.add(_c(0))
    o.add(_c(2))
    assert o.add(_c(0)) == [] and o.add(_c(2)) == [] and o.duplicates == 2
    o.end(2)  # the done says 2 chunks: the held seq 2 was never part of the answer
    assert o.missing() == [(1, 2)] and o.add(_c(5)) == []
    assert [c.seq for c in o.add(_c(1))] == [1] and o.whole


def test_the_request_and_the_holding_are_bounded() -> None:
    o = ChunkOrder(max_held=10)
    for k in range(1, 2 * MAX_RESEND_RANGES + 4, 2):  # every other chunk lost
        o.add(_c(k))
    assert len(o.missing()) == MAX_RESEND_RANGES
    assert o.overflow


def test_an_older_routers_done_without_a_count_checks_only_the_held() -> None:
    o = ChunkOrder()
    o.add(_c(0))
    o.end(None)
    assert o.whole


class FakeNats:
    """Just enough of a nats-py client for ``submit()``: ``script(fake, inbox)`` plays the
    router's messages when the submission is published; ``on_resend(fake, resend)`` answers a
    client's ``bear.resend/1``."""

    max_payload = 1 << 20

    def __init__(self, script: Callable[[FakeNats], list[Reply]],
                 on_resend: Callable[[FakeNats, Any], list[Reply]] | None = None) -> None:
        self.script = script
        self.on_resend = on_resend
        self.inbox = "_INBOX.fake"
        self.cb: Any = None
        self.published: list[tuple[str, bytes]] = []
        self.resends: list[Any] = []
        self.stats = {"reconnects": 0}
        self.qid = ""
        self.nonce = ""

    def new_inbox(self) -> str:
        return self.inbox

    async def subscribe(self, subject: str, cb: Any, **_: Any) -> Any:
        self.cb = cb

        class Sub:
            async def unsubscribe(self) -> None:
                return None

        return Sub()

    async def request(self, *_: Any, **__: Any) -> Any:  # the terminal record: none
        raise TimeoutError

    async def deliver(self, msgs: list[Reply]) -> None:
        class Msg:
            def __init__(self, data: bytes) -> None:
                self.data = data

        for m in msgs:
            m.query_id, m.nonce = self.qid, self.nonce
            await self.cb(Msg(encode_reply(m)))

    async def publish(self, subject: str, data: bytes, **_: Any) -> None:
        self.published.append((subject, data))
        if subject == S.cancel:
            r = decode_resend(data)
            if r is not None:
                self.resends.append(r)
                if self.on_resend is not None:
                    await self.deliver(self.on_resend(self, r))
            return
        from bear.protocol.codec import unpack_map

        q = unpack_map(data)
        self.qid, self.nonce = q["query_id"], q["nonce"]
        await self.deliver(self.script(self))


def answer(n: int, lost: set[int]) -> Callable[[FakeNats], list[Reply]]:
    def script(_: FakeNats) -> list[Reply]:
        return [Routed(instance="a"), *[_c(k) for k in range(n) if k not in lost], Done(instance="a", chunks=n)]
    return script


def resend_all(fake: FakeNats, r: Any) -> list[Reply]:
    return [_c(seq) for a, b in r.missing for seq in range(a, b)]


async def _collect(nc: Any, **kw: Any) -> list[Reply]:
    return await asyncio.wait_for(_gather(nc, **kw), HANG_S)


async def _gather(nc: Any, **kw: Any) -> list[Reply]:
    return [m async for m in submit(nc, "hello", accept_timeout_s=HANG_S, idle_timeout_s=HANG_S, **kw)]


def _check_invariant(got: list[Reply], n: int) -> None:
    """Whole (every seq, in order, then done) or a coded error; never done with a gap."""
    seqs = [m.seq for m in got if isinstance(m, Chunk)]
    end = got[-1]
    assert isinstance(end, Done | Error)
    if isinstance(end, Done):
        assert seqs == list(range(n)), f"done with chunks missing: {seqs}"
    else:
        assert seqs == list(range(len(seqs))), "chunks out of order before the error"


@pytest.mark.parametrize("lost", [{3}, {3, 4, 5, 9}, {0}, {11}, {10, 11}], ids=["one", "several", "first", "last",
                                                                               "tail"])
async def test_lost_chunks_are_asked_for_and_the_answer_is_whole(lost: set[int]) -> None:
    before = dict(client.RESUMED)
    nc = FakeNats(answer(12, lost), resend_all)
    got = await _collect(nc)
    _check_invariant(got, 12)
    assert isinstance(got[-1], Done)
    assert {s for r in nc.resends for a, b in r.missing for s in range(a, b)} >= lost
    assert all(r.inbox == nc.inbox and r.query_id == nc.qid and r.nonce == nc.nonce for r in nc.resends)
    assert client.RESUMED["answers"] == before["answers"] + 1
    assert client.RESUMED["chunks"] >= before["chunks"] + len(lost)


async def test_a_gap_never_filled_ends_in_the_coded_error_naming_it() -> None:
    before = dict(client.RESUMED)
    nc = FakeNats(answer(12, {4, 5, 11}))  # nobody answers the resend requests
    got = await _collect(nc, resume_s=0.3, recover_s=0.1)
    _check_invariant(got, 12)
    end = got[-1]
    assert isinstance(end, Error) and end.code == ErrorCode.INCOMPLETE and end.client is True
    assert "3 chunk(s) of 12 lost" in end.message and "seq 4–5, 11" in end.message, end.message
    assert [m.seq for m in got if isinstance(m, Chunk)] == [0, 1, 2, 3]  # nothing past the gap
    assert len(nc.resends) >= 2, "asked again while the gap stayed open"
    assert client.RESUMED["incomplete"] == before["incomplete"] + 1
    assert not [s for s, d in nc.published if s == S.cancel and decode_resend(d) is None], \
        "no bear.cancel/1: the router's done had come"


async def test_chunks_resent_in_part_keep_the_gap_open_until_all_come() -> None:
    def first_only(fake: FakeNats, r: Any) -> list[Reply]:  # each request fills one chunk of the gap
        a, _ = r.missing[0]
        return [_c(a)]

    nc = FakeNats(answer(8, {2, 3, 4}), first_only)
    got = await _collect(nc, recover_s=0.05, resume_s=HANG_S)
    _check_invariant(got, 8)
    assert isinstance(got[-1], Done) and len(nc.resends) >= 3


async def test_too_many_chunks_behind_a_gap_end_the_answer_and_cancel_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "MAX_HELD", 5)
    nc = FakeNats(answer(20, {1}))
    got = await _collect(nc)
    assert isinstance(got[-1], Error) and got[-1].code == ErrorCode.INCOMPLETE
    assert [m.seq for m in got if isinstance(m, Chunk)] == [0]
    cancels = [d for s, d in nc.published if s == S.cancel and decode_resend(d) is None]
    assert cancels, "the router still streaming is told that nobody waits"
