"""Issue 41: a router that died took the answers it was relaying with it, and their clients waited
out their timeout (2 of 240 lost per router-pod kill). Now an accepted query whose stream goes
silent is resubmitted as a takeover (``Submit.takeover``: the chunks the client holds); another
router runs it when NATS says the owner is gone and no chunk reached the client, answers
``incomplete`` when some had, and ``duplicate`` — running nothing — while the owner lives
(``bear.router.takeover``).

Against a real nats-server (JetStream: the dedup claims) with real ``RouterService``s and a fake
engine; a router's death is its NATS connection and its tasks ending, as a SIGKILL ends them."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats

from bear.client import submit as client
from bear.client.submit import submit
from bear.protocol.errors import ErrorCode
from bear.protocol.messages import encode
from bear.protocol.replies import Chunk, Done, Error, Reply, Routed, decode_reply
from bear.protocol.subjects import Subjects
from bear.protocol.submit import Submit
from bear.router.dedup import Deduplicator
from bear.router.service import RouterConfig, RouterService
from bear.runtime.kv import ensure_kv

from fake_engine import FakeEngine, register
from waiting import HANG_S, wait_until

S = Subjects()
FAST = {"predict_budget_s": 0.05, "predict_try_s": 0.025, "estimate_budget_s": 0.05, "estimate_try_s": 0.025}
TOKENS = 6


@contextlib.asynccontextmanager
async def router(url: str, tmp_path: Path, name: str) -> AsyncIterator[tuple[Any, RouterService]]:
    nc = await nats.connect(url)
    r = RouterService(nc, RouterConfig(name=name, outcome_log=tmp_path / f"{name}.jsonl", **FAST))
    await r.start()
    try:
        await wait_until(lambda: [i.id for i in r.registry.healthy()] == ["e0"], what=f"{name} sees the engine")
        yield nc, r
    finally:
        if not nc.is_closed:
            await r.stop(drain_s=0.5)
            await nc.close()


async def crash(nc: Any, r: RouterService) -> None:
    """As SIGKILL: the connection gone (its subscriptions with it), its tasks ended, nothing said."""
    await nc.close()
    for t in list(r._tasks):
        t.cancel()
    await asyncio.gather(*r._tasks, return_exceptions=True)
    await r.registry.stop()


async def test_a_query_whose_router_dies_before_its_first_token_runs_on_another(nats_server, tmp_path) -> None:
    eng = await FakeEngine(tokens=TOKENS, held=True).start()
    nc = await nats.connect(nats_server.url)
    await register(nc, "e0", "m/e0", eng.port)
    before = client.TAKEOVERS["asked"]
    got: list[Reply] = []
    try:
        async with router(nats_server.url, tmp_path, "router-a") as (nc_a, ra):
            async def ask() -> None:
                async for m in submit(nc, "hello", query_id="q-1", max_tokens=TOKENS, accept_timeout_s=HANG_S,
                                      idle_timeout_s=HANG_S, recover_s=0.3):
                    got.append(m)

            task = asyncio.create_task(ask())
            await wait_until(lambda: any(isinstance(m, Routed) for m in got) and len(eng.requests) == 1,
                             what="router-a dispatched q-1 (its engine holds the answer)")
            async with router(nats_server.url, tmp_path, "router-b"):
                await crash(nc_a, ra)
                eng.release.set()
                await asyncio.wait_for(task, HANG_S)
    finally:
        await eng.stop()
        await nc.close()
    end = got[-1]
    assert isinstance(end, Done), end
    assert [m.seq for m in got if isinstance(m, Chunk)] == list(range(end.chunks)) and end.chunks >= 1
    assert sum(isinstance(m, Done | Error) for m in got) == 1
    assert len(eng.requests) == 2  # router-a's, ended with it, and router-b's
    recs = [json.loads(ln) for ln in (tmp_path / "router-b.jsonl").read_text().splitlines()]
    done = [r for r in recs if r["status"] == "done"]
    assert [(r["query_id"], r["taken_over_from"]) for r in done] == [("q-1", "router-a")]
    assert client.TAKEOVERS["asked"] > before


async def _takeover(nc: Any, qid: str, held: int) -> list[Reply]:
    """One takeover resubmission of ``qid`` (as the client library sends it) and its replies."""
    inbox = nc.new_inbox()
    q: asyncio.Queue[Any] = asyncio.Queue()
    sub = await nc.subscribe(inbox, cb=q.put)
    await nc.publish(S.submit, encode(Submit(query_id=qid, prompt="hello", max_tokens=TOKENS, takeover=held,
                                             nonce="00" * 8)), reply=inbox)
    out: list[Reply] = []
    while not out or not isinstance(out[-1], Done | Error):
        m = decode_reply((await asyncio.wait_for(q.get(), HANG_S)).data)
        if m is not None:
            out.append(m)
    await sub.unsubscribe()
    return out


async def _claim(nc: Any, qid: str, owner: str) -> None:
    kv = await ensure_kv(nc.jetstream(), S.queries_bucket)
    await kv.create(Deduplicator.key(qid), owner.encode())


async def test_a_takeover_runs_nothing_while_the_owner_lives_and_is_incomplete_after_chunks(nats_server,
                                                                                          tmp_path) -> None:
    eng = await FakeEngine(tokens=TOKENS).start()
    nc = await nats.connect(nats_server.url)
    await register(nc, "e0", "m/e0", eng.port)
    try:
        async with router(nats_server.url, tmp_path, "router-a"), router(nats_server.url, tmp_path, "router-b"):
            # owned by a live router: duplicate, nothing run (whichever of the two hears it)
            await _claim(nc, "q-alive", "router-a")
            got = await _takeover(nc, "q-alive", 0)
            assert isinstance(got[-1], Error) and got[-1].code == ErrorCode.DUPLICATE, got
            # no claim at all (expired, never written): nothing to take over, nothing run
            got = await _takeover(nc, "q-unclaimed", 0)
            assert isinstance(got[-1], Error) and got[-1].code == ErrorCode.DUPLICATE, got
            # owned by a router nobody answers for, 3 chunks already with the client: incomplete, nothing run
            await _claim(nc, "q-cut", "router-dead")
            got = await _takeover(nc, "q-cut", 3)
            assert isinstance(got[-1], Error) and got[-1].code == ErrorCode.INCOMPLETE, got
            assert "router-dead" in got[-1].error.message and "3 chunks" in got[-1].error.message
            assert eng.requests == []
            # the same owner, no chunk with the client: run here, once
            await _claim(nc, "q-run", "router-dead")
            got = await _takeover(nc, "q-run", 0)
            assert isinstance(got[-1], Done), got
            assert len(eng.requests) == 1
            # and a second takeover of it finds a live owner (the router that took it): duplicate
            got = await _takeover(nc, "q-run", 0)
            assert isinstance(got[-1], Error) and got[-1].code == ErrorCode.DUPLICATE, got
            assert len(eng.requests) == 1
    finally:
        await eng.stop()
        await nc.close()
