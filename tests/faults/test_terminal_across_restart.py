"""Issue 26, item 5: a NATS restart lost accepted queries. The router's ``done``, published while
the broker was away, was buffered by nats-py and sent on its reconnect — before the client had
reconnected and subscribed again — so nobody received it; the client heard 30 s of silence, then
ended the query ``deadline_exceeded``. Now the router also keeps each terminal message in
JetStream (``Subjects.terminals_bucket``, under a hash of the answer's inbox) and the client
library reads it when its stream goes silent (``bear.client.submit.terminal_record``).

Reproduced deterministically against a real nats-server with ``bear up``'s credentials: the
router's side is the real ``ClientStream``, the client the real ``submit()``; the router
reconnects at once, the client only seconds later."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import tempfile
from pathlib import Path
from typing import Any

from bear.client.submit import submit
from bear.protocol.codec import unpack_map
from bear.protocol.replies import Done, Reply, Routed
from bear.protocol.subjects import Subjects
from bear.router.client_stream import ClientStream
from bear.runtime.kv import provision
from bear.runtime.nats_auth import generate
from bear.runtime.nats_server import LocalNatsServer
from bear.runtime.service import connect

from waiting import HANG_S, wait_until

S = Subjects()


def _stream(nc: Any, inbox: str, qid: str, nonce: str) -> ClientStream:
    extra = {"terminals": S.terminals_bucket} if "terminals" in inspect.signature(ClientStream).parameters else {}
    return ClientStream(nc, inbox, qid, nonce=nonce, **extra)


async def test_done_published_while_nats_restarts_reaches_the_client(tmp_path: Path) -> None:
    files = generate(tmp_path / "auth", [])
    store = tempfile.mkdtemp(prefix="bear-nats-", dir=tmp_path)
    srv = LocalNatsServer(config=files.config, store_dir=store).start()
    conns: list[Any] = []
    try:
        admin = await connect(srv.url, "admin", creds=files.path("admin"))
        conns.append(admin)
        await provision(admin.jetstream(timeout=5.0), S)
        router = await connect(srv.url, "router", creds=files.path("router"), reconnect_time_wait=0.1)
        client_reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            client_reconnected.set()

        # the client comes back later than the router (as one of many clients does): 10 s, so
        # that a loaded host's slow broker restart still sees the router back first
        client = await connect(srv.url, "client", creds=files.path("client"), reconnect_time_wait=10.0,
                               reconnected_cb=on_reconnect)
        conns += [router, client]
        submits: asyncio.Queue[Any] = asyncio.Queue()
        await router.subscribe(S.submit_all, cb=submits.put)
        await router.flush()

        got: list[Reply] = []

        async def run_client() -> None:
            async for m in submit(client, "hello", idle_timeout_s=HANG_S, accept_timeout_s=HANG_S, resubmits=0):
                got.append(m)

        task = asyncio.create_task(run_client())
        msg = await asyncio.wait_for(submits.get(), HANG_S)
        q = unpack_map(msg.data)
        out = _stream(router, msg.reply, q["query_id"], q["nonce"])
        await out.send(Routed(instance="a", attempt=1))
        await router.flush()
        await wait_until(lambda: len(got) == 1, what="the routed message at the client")

        await asyncio.to_thread(srv.stop)  # the broker goes away; the query finishes meanwhile
        await wait_until(lambda: not router.is_connected, what="the router noticing the outage")
        await out.finish(Done(instance="a", usage={"completion_tokens": 3}))  # buffered by nats-py
        await asyncio.to_thread(srv.start)
        await wait_until(lambda: router.is_connected, what="the router reconnected")
        await router.flush()  # its buffered done has reached the new server
        assert not client_reconnected.is_set(), "precondition: the router reconnected first"
        await asyncio.wait_for(task, 2 * HANG_S)
        kinds = [m.v for m in got]
        assert kinds == ["bear.routed/1", "bear.done/1"], f"the accepted query ended {got[-1]}"
    finally:
        for nc in conns:
            with contextlib.suppress(Exception):
                await nc.close()
        srv.close()
