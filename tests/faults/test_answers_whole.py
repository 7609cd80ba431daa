"""Issue 40, item 1: a NATS restart while long answers streamed made some end with ``done`` but
miss chunks — the client library never checked ``Chunk.seq``. Now an answer is whole or ends in a
coded error: the router keeps the chunks it relayed (``AnswerKeeper``) and ``Done.chunks`` says
how many there were; the client library yields chunks in ``seq`` order, asks for a gap with a
``bear.resend/1`` on ``bear.cancel``, and ends ``incomplete`` when nobody sends it again.

Against a real nats-server: the router is the real ``RouterService`` (a fake engine behind it)
whose connection drops chosen chunks on their way to the client, or the real ``ClientStream`` and
``AnswerKeeper`` across a real restart (SIGTERM and SIGKILL) with ``bear up``'s credentials,
where the router's buffered chunks reach the new server before the client has subscribed again."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import pytest

from bear.client import submit as client
from bear.client.submit import submit
from bear.protocol.codec import unpack_map
from bear.protocol.errors import ErrorCode
from bear.protocol.replies import Chunk, Done, Error, Reply, Routed, decode_reply
from bear.protocol.subjects import Subjects
from bear.router.client_stream import AnswerKeeper, ClientStream, TerminalResender
from bear.router.service import RouterConfig, RouterService
from bear.runtime.kv import provision
from bear.runtime.nats_auth import generate
from bear.runtime.nats_server import LocalNatsServer
from bear.runtime.service import connect

from fake_engine import FakeEngine, register
from waiting import HANG_S, wait_until

S = Subjects()
FAST = {"predict_budget_s": 0.05, "predict_try_s": 0.025, "estimate_budget_s": 0.05, "estimate_try_s": 0.025,
        "coalesce": False}  # one chunk per engine token: the seqs the test drops are the engine's tokens
TOKENS = 40


class Lossy:
    """A router's NATS connection that drops the publishes ``drop(subject, data)`` picks (chunks
    lost between the router and the client, as in a NATS restart); everything else passes."""

    def __init__(self, nc: Any, drop: Callable[[str, bytes], bool]) -> None:
        self._nc = nc
        self._drop = drop
        self.dropped: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nc, name)

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "", headers: Any = None) -> None:
        if self._drop(subject, payload):
            m = decode_reply(payload)
            self.dropped.append(m.seq if isinstance(m, Chunk) else -1)
            return
        await self._nc.publish(subject, payload, reply=reply, headers=headers)


def chunks_with_seq(seqs: set[int], *, once: bool) -> Callable[[str, bytes], bool]:
    """Drop the chunks of ``seqs`` to a client inbox (``once``: only their first publish)."""
    gone: set[int] = set()

    def drop(subject: str, data: bytes) -> bool:
        if not subject.startswith("_INBOX"):
            return False
        m = decode_reply(data)
        if not isinstance(m, Chunk) or m.seq not in seqs or (once and m.seq in gone):
            return False
        gone.add(m.seq)
        return True

    return drop


@contextlib.asynccontextmanager
async def lossy_router(nats_server: Any, tmp_path: Path, drop: Callable[[str, bytes], bool]):
    nc = await nats.connect(nats_server.url)
    eng = await FakeEngine(tokens=TOKENS).start()
    await register(nc, "e0", "m/e0", eng.port)
    lossy = Lossy(nc, drop)
    router = RouterService(lossy, RouterConfig(outcome_log=tmp_path / "out.jsonl", **FAST))
    await router.start()
    try:
        await wait_until(lambda: [i.id for i in router.registry.healthy()] == ["e0"], what="the engine registered")
        yield nc, router, lossy
    finally:
        await router.stop()
        await eng.stop()
        await nc.close()


def assert_whole_or_coded(got: list[Reply], n: int) -> None:
    """The invariant: done only with every chunk, in seq order; else a coded error."""
    seqs = [m.seq for m in got if isinstance(m, Chunk)]
    end = got[-1]
    assert isinstance(end, Done | Error), f"no terminal message: {end}"
    assert seqs == list(range(len(seqs))), f"chunks out of order or with a gap: {seqs}"
    if isinstance(end, Done):
        assert len(seqs) == n == end.chunks, f"done with {len(seqs)} of {end.chunks} chunks"
    else:
        assert end.code, "an error without a code"


async def _ask(nc: Any, **kw: Any) -> list[Reply]:
    async def run() -> list[Reply]:
        return [m async for m in submit(nc, "hello", max_tokens=TOKENS, accept_timeout_s=HANG_S,
                                        idle_timeout_s=HANG_S, **kw)]
    return await asyncio.wait_for(run(), 2 * HANG_S)


async def test_chunks_dropped_on_the_way_are_sent_again_and_the_answer_is_whole(nats_server, tmp_path) -> None:
    lost = {5, 6, 7, 20, TOKENS - 1}  # within the answer and its last chunk (only the done can tell)
    before = dict(client.RESUMED)
    async with lossy_router(nats_server, tmp_path, chunks_with_seq(lost, once=True)) as (nc, router, lossy):
        got = await _ask(nc)
        assert sorted(lossy.dropped) == sorted(lost), "precondition: the chunks were dropped"
        assert_whole_or_coded(got, TOKENS)
        assert isinstance(got[-1], Done), got[-1]
        text = "".join(m.text for m in got if isinstance(m, Chunk))  # type: ignore[misc]
        assert text == "".join(f"t{k} " for k in range(TOKENS))
        assert router.keeper.stats["chunks"] >= len(lost) and router.keeper.stats["served"] >= 1
    assert client.RESUMED["answers"] == before["answers"] + 1
    assert client.RESUMED["chunks"] >= before["chunks"] + len(lost)


async def test_chunks_never_sent_again_end_in_the_coded_error(nats_server, tmp_path) -> None:
    before = dict(client.RESUMED)
    async with lossy_router(nats_server, tmp_path, chunks_with_seq({9, 10}, once=False)) as (nc, router, lossy):
        got = await _ask(nc, recover_s=0.2, resume_s=0.6)  # resume_s: how long it waits for the gap
        assert_whole_or_coded(got, TOKENS)
        end = got[-1]
        assert isinstance(end, Error) and end.code == ErrorCode.INCOMPLETE and end.client is True
        assert f"2 chunk(s) of {TOKENS} lost" in end.message and "seq 9–10" in end.message, end.message
        assert len(lossy.dropped) > 2, "the router did send them again (and they were dropped again)"
        assert router.keeper.stats["served"] >= 1
    assert client.RESUMED["incomplete"] == before["incomplete"] + 1


async def test_a_resend_request_of_another_nonce_or_inbox_is_refused(nats_server, tmp_path) -> None:
    """Only the client holding the answer's inbox and nonce gets chunks sent again."""
    from bear.protocol.messages import encode
    from bear.protocol.submit import Resend

    async with lossy_router(nats_server, tmp_path, lambda s, d: False) as (nc, router, _):
        inbox = nc.new_inbox()
        seen: asyncio.Queue[Any] = asyncio.Queue()
        await nc.subscribe(inbox + ".spy", cb=seen.put)
        got = await _ask(nc)
        assert isinstance(got[-1], Done)
        answer_inbox, k = next(iter(router.keeper.answers.items()))
        await nc.publish(S.cancel, encode(Resend(query_id=k.query_id, inbox=answer_inbox, nonce="forged",
                                                 missing=[(0, TOKENS)])))
        await nc.publish(S.cancel, encode(Resend(query_id=k.query_id, inbox=inbox + ".spy", nonce=k.nonce or "x",
                                                 missing=[(0, TOKENS)])))
        await wait_until(lambda: router.keeper.stats["refused"] + router.keeper.stats["unknown"] >= 2,
                         what="both requests heard")
        assert router.keeper.stats["chunks"] == 0 and seen.empty()


async def _first_submission(submits: asyncio.Queue[Any], client_task: asyncio.Task[Any], nc: Any,
                            router: Any) -> Any:
    """The first submission the router heard; a client that failed first raises its error, and a
    submission never heard says what each connection saw (CI once waited here 60 s in vain)."""
    getter = asyncio.ensure_future(submits.get())
    done, _ = await asyncio.wait({getter, client_task}, timeout=HANG_S, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    if client_task in done:
        raise AssertionError(f"the client ended before the router heard it: {client_task.result()!r}")
    raise AssertionError(f"no submission heard in {HANG_S} s: client connected={nc.is_connected} "
                         f"stats={dict(nc.stats)}; router connected={router.is_connected} stats={dict(router.stats)}")


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_chunks_published_while_nats_restarts_are_resumed(tmp_path: Path, how: signal.Signals) -> None:
    files = generate(tmp_path / "auth", [])
    store = tempfile.mkdtemp(prefix="bear-nats-", dir=tmp_path)
    srv = LocalNatsServer(config=files.config, store_dir=store).start()
    conns: list[Any] = []
    tasks: list[asyncio.Task[Any]] = []
    try:
        admin = await connect(srv.url, "admin", creds=files.path("admin"))
        conns.append(admin)
        await provision(admin.jetstream(timeout=5.0), S)
        router = await connect(srv.url, "router", creds=files.path("router"), reconnect_time_wait=0.1)
        client_reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            client_reconnected.set()

        # the client comes back later than the router (as one of many clients does)
        nc = await connect(srv.url, "client", creds=files.path("client"), reconnect_time_wait=10.0,
                           reconnected_cb=on_reconnect)
        conns += [router, nc]
        keeper = AnswerKeeper(router)
        resender = TerminalResender(router, S.terminals_bucket)
        tasks.append(asyncio.create_task(resender.run()))
        submits: asyncio.Queue[Any] = asyncio.Queue()
        await router.subscribe(S.submit_all, cb=submits.put)

        async def on_cancel(msg: Any) -> None:  # as RouterService._on_cancel: a bear.resend/1 served
            await keeper.hear(msg.data)

        await router.subscribe(S.cancel, cb=on_cancel)
        await router.flush()

        got: list[Reply] = []

        async def run_client() -> None:
            # a submission lost on its way (core NATS) is sent again, as the client library does
            async for m in submit(nc, "hello", idle_timeout_s=HANG_S, accept_timeout_s=2.0, resubmits=int(HANG_S / 2)):
                got.append(m)

        tasks.append(asyncio.create_task(run_client()))
        msg = await _first_submission(submits, tasks[-1], nc, router)
        q = unpack_map(msg.data)
        out = ClientStream(router, msg.reply, q["query_id"], resender.recent, nonce=q["nonce"],
                           terminals=S.terminals_bucket, keeper=keeper)
        await out.send(Routed(instance="a", attempt=1))
        for k in range(5):
            await out.send(Chunk(seq=k, text=f"t{k} "))
        await router.flush()
        await wait_until(lambda: len(got) == 6, what="the first chunks at the client")

        if how == signal.SIGKILL:
            srv.proc.kill()  # type: ignore[union-attr]
            srv.proc.wait()  # type: ignore[union-attr]
            srv.proc = None
        else:
            await asyncio.to_thread(srv.stop)
        await wait_until(lambda: not router.is_connected, what="the router noticing the outage")
        for k in range(5, 10):  # buffered by nats-py: they reach the new server before the client
            await out.send(Chunk(seq=k, text=f"t{k} "))
        await out.finish(Done(instance="a", usage={"completion_tokens": 10}))
        await asyncio.to_thread(srv.start)
        await wait_until(lambda: router.is_connected, what="the router reconnected")
        await router.flush()
        assert not client_reconnected.is_set(), "precondition: the router reconnected first"
        await asyncio.wait_for(tasks[-1], 2 * HANG_S)
        assert client_reconnected.is_set()
        assert_whole_or_coded(got[1:], 10)
        assert isinstance(got[-1], Done), f"the answer ended {got[-1]}"
        assert keeper.stats["chunks"] >= 5, keeper.stats
    finally:
        for t in tasks:
            t.cancel()
        for c in conns:
            with contextlib.suppress(Exception):
                await c.close()
        srv.close()
