"""Issue 26, items 2 and 3, against a real nats-server with ``bear up``'s credentials and a real
router: a client identity reads and steers only its own answers.

* 2 — each client has an identity of its own (``bear nats config --client``, ``bear up
  --client``): nobody reads another's inbox, and the client library takes only messages of its
  own query (query id and the per-query nonce the router echoes) — an injected answer is dropped.
* 3 — the router answers only into the submitter's own inbox: a submit naming another reply
  subject (an outcome or dispatch subject, the gateway's or admin's inbox, the dedup bucket,
  another client's inbox) is answered nowhere, and query-id bucket keys are the router's."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from secured_pool import S, SecuredPool, publish_quietly, secured_pool

from bear.client import submit as client_lib
from bear.client.submit import submit
from bear.protocol.codec import pack

from waiting import HANG_S, wait_until

CLIENTS = ("client", "gateway", "alice", "bob")


def _query(qid: str, prompt: str) -> bytes:
    return pack({"v": "bear.submit/1", "query_id": qid, "prompt": prompt, "max_tokens": 2, "ttft_target_s": 5.0})


async def _answer(nc: Any, prompt: str, qid: str) -> list[dict[str, Any]]:
    return [m async for m in submit(nc, prompt, query_id=qid, ttft_target_s=5.0, max_tokens=2, accept_timeout_s=5.0,
                                    resubmits=0)]


async def _everything_routed(pool: SecuredPool, alice: Any, held: int = 0) -> None:
    """Return once the router has taken (and finished) every submit alice published before: her
    control query answered (the server delivers her messages in order, and the router's
    subscription takes them in order; a submit the server refused never arrives), and no query
    left in the router but the ``held`` ones."""
    got = await _answer(alice, "control", "control-alice")
    assert got[-1]["v"] == "bear.done/1", got
    router = pool.routers[0]
    await wait_until(lambda: len(router._tasks) <= held, what="the router to finish every other query")



async def serving_a(pool: Any) -> tuple[Any, Any]:
    """Instance a registered and a router that routes to it: (its engine, the router)."""
    engine = await pool.engine("a")
    await pool.register("a", engine.url)
    router = await pool.router({"a": "key-a"})
    await wait_until(lambda: len(router.registry.healthy()) == 1, what="instance a registered")
    return engine, router

async def test_router_answers_only_into_the_submitters_inbox(tmp_path: Path) -> None:
    """Item 3: with a client identity, answers were published onto bear.outcome.<id>,
    bear.dispatch.<id>, the gateway's and admin's inboxes and into the query-id bucket under a
    key the client chose. Now none of them receives anything; every such submit is counted."""
    async with secured_pool(tmp_path, ["a"], CLIENTS) as pool:
        engine, router = await serving_a(pool)
        admin = await pool.nc("admin")
        alice = await pool.nc("alice")
        targets = [S.outcome("a"), S.dispatch("a"), "_INBOX_gateway.x1", "_INBOX_admin.x1", "_INBOX_bob.x1",
                   f"$KV.{S.queries_bucket}.chosen"]
        landed: list[str] = []

        async def seen(msg: Any) -> None:
            if b"attack-" in msg.data:  # an answer to an attack (not the control query's own dispatch)
                landed.append(msg.subject)

        subs = [await admin.subscribe(t, cb=seen) for t in targets]
        await admin.flush()
        attacks = 0
        for k, target in enumerate(targets):
            for subject in (S.submit, "bear.submit.alice", "bear.submit.bob"):
                await publish_quietly(alice, subject, _query(f"attack-{k}-{subject}", "steer"), reply=target)
                attacks += 1
        await _everything_routed(pool, alice)
        await admin.flush()
        await wait_until(lambda: all(s.pending_msgs == 0 for s in subs), what="the subscriptions' queues emptied")
        kv = await admin.jetstream(timeout=5.0).key_value(S.queries_bucket)
        chosen = None
        with contextlib.suppress(Exception):
            chosen = await kv.get("chosen")
        engine_prompts = [p for p, _ in engine.requests]
        print(f"item 3: {len(landed)} answers landed on {sorted(set(landed))}; "
              f"{engine_prompts.count('steer')} attack queries executed of {attacks}")
        assert landed == [] and chosen is None
        assert "steer" not in engine_prompts  # nothing was executed for an answer nobody may see
        assert router.refused_replies > 0  # what reached the router (not refused by the server) was counted


async def test_query_id_keys_are_scoped_by_client(tmp_path: Path) -> None:
    """Item 3: dedup keys are the router's (hash of client and id): one client's ids do not
    block another's, while a client's own resubmission is still a duplicate."""
    async with secured_pool(tmp_path, ["a"], CLIENTS) as pool:
        await serving_a(pool)
        alice, bob = await pool.nc("alice"), await pool.nc("bob")
        assert (await _answer(alice, "first", "same-id"))[-1]["v"] == "bear.done/1"
        assert (await _answer(bob, "second", "same-id"))[-1]["v"] == "bear.done/1"  # not alice's duplicate
        again = await _answer(alice, "first", "same-id")
        assert again[-1].get("error", {}).get("code") == "duplicate", again


async def test_one_client_cannot_read_or_inject_into_anothers_answers(tmp_path: Path) -> None:
    """Item 2: all command-line clients shared one identity, so one read every other user's
    inbox and, knowing an inbox, had the router answer into it — the library accepted the
    forged answers. Now alice cannot subscribe to bob's inbox, the router does not answer her
    submits into it, and a message without bob's query id and nonce is dropped by his library."""
    async with secured_pool(tmp_path, ["a"], CLIENTS) as pool:
        engine, router = await serving_a(pool)
        alice, bob = await pool.nc("alice"), await pool.nc("bob")
        read: list[Any] = []

        async def snoop(msg: Any) -> None:
            read.append(msg)

        snoops = []
        for pattern in ("_INBOX_bob.>", "_INBOX_client.>", "_INBOX.>", ">"):
            with contextlib.suppress(Exception):
                snoops.append(await alice.subscribe(pattern, cb=snoop))
        await alice.flush()
        bob_got: list[dict[str, Any]] = []
        bob_task = asyncio.create_task(_collect(bob, "hold: bob's question", "bob-q", bob_got))
        await wait_until(lambda: "bob-q" in router._inboxes and engine.requests, what="bob's query at the engine")
        inbox = router._inboxes["bob-q"]  # what a shared identity let alice read
        assert inbox.startswith("_INBOX_bob.")
        injected = 0
        for k in range(5):  # the router asked to answer alice's queries into bob's inbox
            for subject in (S.submit, "bear.submit.alice", "bear.submit.bob"):
                await publish_quietly(alice, subject, _query(f"inject-{k}-{subject}", "FORGED"), reply=inbox)
                injected += 1
        await _everything_routed(pool, alice, held=1)
        engine.release.set()
        await asyncio.wait_for(bob_task, HANG_S)
        for s in snoops:
            await alice.flush()
            await wait_until(lambda s=s: s.pending_msgs == 0, what="alice's subscriptions emptied")
        forged = [m for m in bob_got if m.get("query_id") != "bob-q" or "FORGED" in str(m)]
        print(f"item 2: alice read {len(read)} messages of other clients; {len(forged)} of {len(bob_got)} messages "
              f"bob's library yielded were forged ({injected} injection attempts)")
        assert read == [] and forged == []
        _assert_one_answer(bob_got)
        assert "".join(m.get("text", "") for m in bob_got) == "a: hold: bob's question"


def _assert_one_answer(got: list[dict[str, Any]]) -> None:
    """routed, the text in one or more chunks (chunks that reached the router in one read are
    relayed as one message), done."""
    kinds = [m["v"] for m in got]
    assert kinds[0] == "bear.routed/1" and kinds[-1] == "bear.done/1", kinds
    assert len(kinds) >= 3 and set(kinds[1:-1]) == {"bear.chunk/1"}, kinds


async def _collect(nc: Any, prompt: str, qid: str, into: list[dict[str, Any]]) -> None:
    async for m in submit(nc, prompt, query_id=qid, ttft_target_s=5.0, max_tokens=2, accept_timeout_s=HANG_S,
                          resubmits=0):
        into.append(m)


async def test_the_client_library_takes_only_its_own_querys_messages(tmp_path: Path) -> None:
    """Item 2: a message in a client's inbox without its query id and the nonce it sent (a
    stray or replayed answer, another query's) is dropped and counted, never yielded."""
    async with secured_pool(tmp_path, ["a"], CLIENTS) as pool:
        engine, router = await serving_a(pool)
        bob = await pool.nc("bob")
        got: list[dict[str, Any]] = []
        task = asyncio.create_task(_collect(bob, "hold: bob's question", "bob-q", got))
        await wait_until(lambda: "bob-q" in router._inboxes and engine.requests, what="bob's query at the engine")
        inbox = router._inboxes["bob-q"]
        dropped0 = getattr(client_lib, "FOREIGN_DROPPED", {}).get("messages", 0)
        stray = await pool.nc("router")  # only routers may publish into bob's inbox
        for forged in ({"v": "bear.done/1", "query_id": "bob-q", "instance": "a"},  # his id, no nonce
                       {"v": "bear.done/1", "query_id": "bob-q", "nonce": "0" * 16},  # a wrong nonce
                       {"v": "bear.done/1", "query_id": "other"}):  # another query's
            await stray.publish(inbox, pack(forged))
        await stray.flush()  # in bob's connection before the engine answers: they arrive first
        engine.release.set()
        await asyncio.wait_for(task, HANG_S)
        print(f"item 2: bob's library yielded {[m['v'] for m in got]}")
        _assert_one_answer(got)
        assert "".join(m.get("text", "") for m in got) == "a: hold: bob's question"
        assert {m["query_id"] for m in got} == {"bob-q"} and got[-1]["instance"] == "a"
        assert client_lib.FOREIGN_DROPPED["messages"] == dropped0 + 3
