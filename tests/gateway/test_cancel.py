"""Cancellation end to end: a consumer of ``submit()`` that stops before the terminal message
publishes ``bear.cancel/1``; the router serving the query aborts its HTTP stream and records
``cancelled``; the sim engine aborts a request whose HTTP client went away (its real runner,
``handler_cancellation``) — the engine no longer holds it: aborted, not run to its end (the
sim engines here never emit EOS, so a request left running would take minutes)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp

from bear.client.submit import submit
from bear.protocol.codec import pack
from bear.protocol.subjects import CANCEL_SCHEMA, Subjects

from waiting import wait_until

LONG = {"max_tokens": 30_000}  # the sim engines here never emit EOS: they run to max_tokens (< context)


async def test_sim_engine_aborts_when_its_http_client_goes_away(pool) -> None:
    sim = pool.sims["sim-small"]
    base = pool.router.registry.get("sim-small").base_url
    for stream in (True, False):  # a streamed answer and a non-streamed one still being generated
        async with aiohttp.ClientSession() as s:

            async def call(s: aiohttp.ClientSession = s, stream: bool = stream) -> None:
                async with s.post(base + "/completions", json={"prompt": "x", "max_tokens": 30_000,
                                                               "stream": stream}) as resp:
                    await resp.read()

            task = asyncio.create_task(call())
            await wait_until(lambda: len(sim._live) == 1 and sim._live[next(iter(sim._live))].output_tokens > 0,
                             what="the request generating")
            task.cancel()  # the client goes away mid-answer
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await wait_until(lambda: not sim._live, what="the engine to drop the request")
        assert not sim.engine.has_work and sim.stats.finished == 0
    assert sim.stats.aborted == 2


async def test_closing_submit_mid_stream_cancels_the_generation(pool) -> None:
    nc = pool.nc
    it = submit(nc, "tell me a long story", query_id="c1", model="Qwen/Qwen3-0.6B", **LONG)
    got = []
    async with contextlib.aclosing(it):
        async for m in it:
            got.append(m["v"])
            if got.count("bear.chunk/1") == 3:
                break  # the consumer stops: aclose publishes bear.cancel/1
    assert got[0] == "bear.routed/1"
    await wait_until(lambda: pool.live_requests() == 0, what="the engine to drop the request")
    assert (_aborted(pool), _finished(pool)) == (1, 0), _stats(pool)  # cancelled, not run to its end
    pool.router.outcomes.flush()
    recs = [json.loads(x) for x in pool.outcome_log.read_text().splitlines()]
    rec = next(r for r in recs if r["query_id"] == "c1")
    assert rec["status"] == "cancelled" and rec["instance"] == "sim-small"
    assert "c1" not in pool.router._by_query and pool.router.local.running["sim-small"] == 0


async def test_cancelled_task_of_the_consumer_cancels_too(pool) -> None:
    """Cancelling the task that iterates (a client disconnect in a server) is the same as closing."""

    async def consume() -> None:
        async for _ in submit(pool.nc, "x", query_id="c2", **LONG):
            pass

    task = asyncio.create_task(consume())
    await wait_until(lambda: pool.live_requests() == 1, what="the request generating")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await wait_until(lambda: pool.live_requests() == 0, what="the engine to drop the request")
    assert (_aborted(pool), _finished(pool)) == (1, 0), _stats(pool)


async def test_cancel_that_overtakes_its_submission_stops_it(pool) -> None:
    """A cancel heard before the submission (different subscriptions, no ordering) is remembered:
    the query is not started, and the other routers' memory keeps a resubmission from running."""
    inbox = pool.nc.new_inbox()
    sub = await pool.nc.subscribe(inbox)
    await pool.nc.publish(Subjects().cancel, pack({"v": CANCEL_SCHEMA, "query_id": "c3", "inbox": inbox}))
    await pool.nc.flush()
    await wait_until(lambda: "c3" in pool.router.cancels, what="the router to hear the cancel")
    await pool.nc.publish(Subjects().submit, pack({"v": "bear.submit/1", "query_id": "c3", "prompt": "x", **LONG}),
                          reply=inbox)
    # the router handled the submission: it recorded the query cancelled ...
    await wait_until(lambda: any(r["query_id"] == "c3" and r["status"] == "cancelled" for r in pool.records()),
                     what="the cancelled query's record")
    # ... and answered no one: anything it had published (on this same connection) before the
    # record would be here after a round trip to the server
    await pool.nc.flush()
    assert sub.pending_msgs == 0, "the router answered a cancelled query"
    assert pool.live_requests() == 0 and (_aborted(pool), _finished(pool)) == (0, 0), _stats(pool)  # never started


async def test_a_cancel_must_name_the_answers_inbox(pool) -> None:
    """Knowing a query id is not enough to cancel someone else's query: the cancel must name the
    inbox the answer goes to (which only that client and its router know)."""
    it = submit(pool.nc, "x", query_id="c5", max_tokens=40)
    msgs = []
    async with contextlib.aclosing(it):
        async for m in it:
            msgs.append(m)
            if m["v"] == "bear.routed/1":
                for forged in ({"query_id": "c5"}, {"query_id": "c5", "inbox": "_INBOX.guess"}):
                    await pool.nc.publish(Subjects().cancel, pack({"v": CANCEL_SCHEMA, **forged}))
    assert msgs[-1]["v"] == "bear.done/1"


async def test_malformed_cancel_is_ignored(pool) -> None:
    for junk in (b"\xc1", pack([1, 2]), pack({"v": "other", "query_id": "x"}), pack({"v": CANCEL_SCHEMA, "query_id": 3})):
        await pool.nc.publish(Subjects().cancel, junk)
    await pool.nc.flush()
    msgs = await _drain(submit(pool.nc, "still works", query_id="c4", max_tokens=2))
    assert msgs[-1]["v"] == "bear.done/1"


async def _drain(it) -> list[dict]:
    return [m async for m in it]


def _aborted(pool) -> int:
    return sum(s.stats.aborted for s in pool.sims.values())


def _finished(pool) -> int:
    return sum(s.stats.finished for s in pool.sims.values())


def _stats(pool) -> dict:
    return {name: s.stats.as_dict() for name, s in pool.sims.items()}
