"""Issue 40, item 1, the router's side without NATS: ``AnswerKeeper`` keeps the chunks a
``ClientStream`` relayed — bounded per answer, in all and in time — and serves a client's
``bear.resend/1`` only for the answer's own inbox and nonce, each chunk at most once per request
and at most ``resends`` requests per answer; the ``done`` says how many chunks there were."""

from __future__ import annotations

import time
from typing import Any

from bear.protocol.messages import encode
from bear.protocol.replies import Chunk, Done, decode_reply
from bear.protocol.submit import Resend
from bear.router.client_stream import AnswerKeeper, ClientStream


class Recorder:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes, **_: Any) -> None:
        self.published.append((subject, data))

    def seqs(self, subject: str) -> list[int]:
        out = []
        for s, d in self.published:
            m = decode_reply(d)
            if s == subject and isinstance(m, Chunk):
                out.append(m.seq)
        return out


async def _answer(nc: Recorder, keeper: AnswerKeeper, inbox: str, n: int, text: str = "x") -> ClientStream:
    out = ClientStream(nc, inbox, f"q-{inbox}", nonce="n1", keeper=keeper)
    for k in range(n):
        await out.send(Chunk(seq=k, text=text))
    await out.finish(Done(instance="a"))
    return out


def _resend(inbox: str, missing: list[tuple[int, int]], nonce: str = "n1") -> bytes:
    return encode(Resend(query_id=f"q-{inbox}", inbox=inbox, nonce=nonce, missing=missing))


async def test_the_done_counts_the_chunks_and_a_gap_is_sent_again_once() -> None:
    nc = Recorder()
    keeper = AnswerKeeper(nc)
    await _answer(nc, keeper, "_INBOX.a", 10)
    done = decode_reply(nc.published[-1][1])
    assert isinstance(done, Done) and done.chunks == 10
    nc.published.clear()
    assert await keeper.hear(_resend("_INBOX.a", [(2, 5), (3, 6), (9, 50), (7, 7)])) == 5
    assert nc.seqs("_INBOX.a") == [2, 3, 4, 5, 9]  # overlaps once, past the end cut, empty ignored


async def test_only_the_answers_inbox_and_nonce_are_served_and_requests_are_capped() -> None:
    nc = Recorder()
    keeper = AnswerKeeper(nc, resends=2)
    await _answer(nc, keeper, "_INBOX.a", 4)
    nc.published.clear()
    assert await keeper.hear(_resend("_INBOX.a", [(0, 4)], nonce="forged")) == 0
    assert await keeper.hear(_resend("_INBOX.other", [(0, 4)])) == 0
    assert await keeper.hear(encode(Resend(query_id="other", inbox="_INBOX.a", nonce="n1", missing=[(0, 4)]))) == 0
    assert await keeper.hear(b"\xc1 not msgpack") == 0
    assert nc.published == []
    assert await keeper.hear(_resend("_INBOX.a", [(0, 1)])) == 1
    assert await keeper.hear(_resend("_INBOX.a", [(0, 1)])) == 1
    assert await keeper.hear(_resend("_INBOX.a", [(0, 1)])) == 0  # over the per-answer limit
    assert keeper.stats["refused"] == 3 and keeper.stats["unknown"] == 1


async def test_one_answer_keeps_a_window_of_its_newest_chunks() -> None:
    nc = Recorder()
    keeper = AnswerKeeper(nc, answer_bytes=400)
    await _answer(nc, keeper, "_INBOX.a", 100)
    k = keeper.answers["_INBOX.a"]
    assert k.bytes <= 400 and k.first > 0 and k.first + len(k.chunks) == 100
    assert keeper.total == k.bytes
    nc.published.clear()
    assert await keeper.hear(_resend("_INBOX.a", [(0, 100)])) == len(k.chunks)
    assert keeper.stats["not_kept"] == k.first


async def test_all_answers_are_bounded_and_expire() -> None:
    nc = Recorder()
    keeper = AnswerKeeper(nc, max_bytes=2000, keep_s=30.0)
    for i in range(20):
        await _answer(nc, keeper, f"_INBOX.{i}", 10, text="y" * 20)
    assert keeper.total <= 2000 and "_INBOX.19" in keeper.answers and "_INBOX.0" not in keeper.answers
    assert keeper.total == sum(k.bytes for k in keeper.answers.values())
    assert keeper.stats["evicted"] > 0
    keeper._trim(time.monotonic() + 31.0)  # as a request or a chunk 31 s later would
    assert keeper.answers == {} and keeper.total == 0  # 30 s after their done: gone
    assert await keeper.hear(_resend("_INBOX.19", [(0, 10)])) == 0
