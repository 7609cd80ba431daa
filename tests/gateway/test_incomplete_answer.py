"""Issue 40, item 1, at the gateway: an answer whose chunks were lost in transit (and not sent
again) is an error there — a 502 ``incomplete`` before the stream started, an SSE error event
instead of ``[DONE]`` after — never a truncated success; chunks sent again make it whole. The
router here is a stand-in on the pool's NATS: the real ``ClientStream`` whose chunk publishes of
chosen seqs are dropped, and the real ``AnswerKeeper`` answering the gateway's ``bear.resend/1``."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest

from bear.client import submit as client
from bear.protocol.codec import unpack_map
from bear.protocol.replies import Chunk, Done, Routed
from bear.protocol.subjects import Subjects
from bear.router.client_stream import AnswerKeeper, ClientStream

from gateway_helpers import KEY, make_pool, stop_pool
from waiting import HANG_S

S = Subjects()
N = 10


class DroppingNats:
    """Publishes of chunks whose seq is in ``drop`` go nowhere (every time)."""

    def __init__(self, nc: Any, drop: set[int]) -> None:
        self.nc, self.drop = nc, drop

    async def publish(self, subject: str, data: bytes, **kw: Any) -> None:
        from bear.protocol.replies import decode_reply

        m = decode_reply(data)
        if isinstance(m, Chunk) and m.seq in self.drop:
            return
        await self.nc.publish(subject, data, **kw)


async def _fake_router(nc: Any, drop: set[int], resend: bool) -> list[Any]:
    """Answers every submission with N chunks (those of ``drop`` lost) and a done; with
    ``resend``, a keeper serves the client's resend requests (the lost chunks reach it then)."""
    keeper = AnswerKeeper(nc)

    async def on_submit(msg: Any) -> None:
        q = unpack_map(msg.data)
        out = ClientStream(DroppingNats(nc, drop), msg.reply, q["query_id"], nonce=q["nonce"], keeper=keeper)
        await out.send(Routed(instance="sim-small", model="m"))
        for k in range(N):
            await out.send(Chunk(seq=k, text=f"w{k} "))
        await out.finish(Done(instance="sim-small", model="m", usage={"completion_tokens": N}))

    async def on_cancel(msg: Any) -> None:
        if resend:
            await keeper.hear(msg.data)

    subs = [await nc.subscribe(S.submit, cb=on_submit), await nc.subscribe(S.cancel, cb=on_cancel)]
    await nc.flush()
    return subs


@pytest.fixture
async def gw(nats_server, tmp_path, monkeypatch):
    monkeypatch.setattr(client, "RESUME_S", 0.5)  # how long the gateway's submit() waits for a gap
    monkeypatch.setattr(client, "RECOVER_S", 0.1)
    p = await make_pool(nats_server.url, tmp_path, router=False, recorder=False)
    yield p
    await stop_pool(p)


async def _call(p: Any, stream: bool) -> tuple[int, str]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        async with s.post(p.base_url + "/completions", json={"model": "bear", "prompt": "hi", "max_tokens": N,
                                                             "stream": stream},
                          timeout=aiohttp.ClientTimeout(total=HANG_S)) as resp:
            return resp.status, await resp.text()


async def _through_cutting_router(gw: Any, stream: bool, *, resend: bool) -> tuple[int, str]:
    """One request through the gateway while a fake router drops chunks 4 and N-1 (and sends
    them again when asked, with ``resend``)."""
    subs = await _fake_router(gw.nc, {4, N - 1}, resend=resend)
    try:
        return await asyncio.wait_for(_call(gw, stream), HANG_S)
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_cut_answer_is_an_error_at_the_gateway(gw, stream: bool) -> None:
    status, body = await _through_cutting_router(gw, stream, resend=False)
    if not stream:
        assert status == 502, body
        err = json.loads(body)["error"]
        assert err["code"] == "incomplete" and "2 chunk(s) of 10 lost" in err["message"], err
        return
    assert status == 200
    events = [line.removeprefix("data: ") for line in body.split("\n") if line.startswith("data: ")]
    assert "[DONE]" not in events, "a cut answer must not end like a whole one"
    last = json.loads(events[-1])
    assert last["error"]["code"] == "incomplete", last
    text = "".join(c["text"] for e in events[:-1] for c in json.loads(e).get("choices", []))
    assert text == "w0 w1 w2 w3 ", "only the chunks before the gap, in order"


async def test_chunks_sent_again_make_the_gateways_answer_whole(gw) -> None:
    before = client.RESUMED["answers"]
    status, body = await _through_cutting_router(gw, False, resend=True)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"] == "".join(f"w{k} " for k in range(N))
    assert client.RESUMED["answers"] == before + 1
