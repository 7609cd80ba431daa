"""Every attack of issue 16 against a nats-server started with the credentials ``bear up``
generates (bear.runtime.nats_auth) is refused — and each part can still do its own job with
exactly the rights it has (so the permission table is minimal *and* sufficient).

An attack counts as refused when what it tried never happens: the forged message never reaches a
subscriber that is allowed to see it, the KV entry is not written, the stream still exists."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bear.protocol.errors import BearError
from bear.protocol.subjects import ESTIMATOR_QUEUE, PREDICTOR_QUEUE, Subjects
from bear.runtime.kv import ensure_kv, provision, watch_kv
from bear.runtime.nats_auth import AuthFiles, generate, revoke
from bear.runtime.nats_server import LocalNatsServer
from bear.runtime.service import connect

from waiting import HANG_S, wait_until

S = Subjects()
INSTANCES = ["a", "b"]


class Env:
    def __init__(self, srv: LocalNatsServer, files: AuthFiles) -> None:
        self.srv = srv
        self.files = files
        self.conns: list[Any] = []

    async def nc(self, name: str) -> Any:
        creds = self.files.instance(name[len("instance-"):]) if name.startswith("instance-") else self.files.path(name)
        nc = await connect(self.srv.url, f"test-{name}", creds=creds, connect_within_s=3.0)
        self.conns.append(nc)
        return nc

    async def close(self) -> None:
        for nc in self.conns:
            with contextlib.suppress(Exception):
                await nc.close()


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    files = generate(tmp_path / "auth", INSTANCES)
    with LocalNatsServer(config=files.config) as srv:
        e = Env(srv, files)
        admin = await e.nc("admin")
        await provision(admin.jetstream(), S)
        try:
            yield e
        finally:
            await e.close()


async def _settled(nc: Any, *subs: Any) -> None:
    """Return once every message the server had routed to ``subs`` (subscriptions of ``nc``) is in
    their callbacks' hands: the server answers a flush after what it queued for the connection
    before it, and the subscriptions' queues are then emptied by their callbacks. A publish flushed
    by its sender before this is called has been routed (or refused) by then: so nothing that
    arrives after it can be of that publish."""
    await nc.flush()
    await wait_until(lambda: all(s.pending_msgs == 0 for s in subs), what="the subscriptions' queues emptied")


async def _received(nc: Any, subject: str, act: Any, expect: int = 0) -> list[Any]:
    """What a subscription of ``nc`` to ``subject`` receives from ``act()`` (which flushes what it
    publishes): everything that had arrived once ``act`` is done (refusals: nothing may arrive),
    or, with ``expect``, once that many arrived (allowed messages: ``act`` is repeated each
    second, at most 10 times, because on a loaded host a first publish was once seen never to
    arrive) and what came with them."""
    got: list[Any] = []
    enough = asyncio.Event()

    async def cb(msg: Any) -> None:
        got.append(msg)
        if len(got) >= expect:
            enough.set()

    sub = await nc.subscribe(subject, cb=cb)
    await nc.flush()
    await act()
    for _ in range(10 if expect else 0):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(enough.wait(), 1.0)
        if enough.is_set():
            break
        await act()
    await _settled(nc, sub)
    await sub.unsubscribe()
    return got


async def _publish(nc: Any, subject: str, data: bytes = b"forged", reply: str = "") -> None:
    with contextlib.suppress(Exception):
        await nc.publish(subject, data, reply=reply)
        await nc.flush()


async def test_anonymous_and_unknown_identities_are_refused(env: Env, tmp_path: Path) -> None:
    with pytest.raises(BearError, match="authorization violation"):
        await connect(env.srv.url, "anon", creds="", connect_within_s=2.0)
    stranger = generate(tmp_path / "other", ["a"])  # a well-formed identity the server does not list
    with pytest.raises(BearError, match="authorization violation"):
        await connect(env.srv.url, "stranger", creds=stranger.path("admin"), connect_within_s=2.0)


async def test_credential_files_are_private(env: Env) -> None:
    assert env.files.directory.stat().st_mode & 0o777 == 0o700
    for path in [env.files.config, *env.files.creds.values()]:
        assert path.stat().st_mode & 0o777 == 0o600, path


async def test_rogue_registration_is_refused(env: Env) -> None:
    """Only instance X writes registry key X: the router never learns of a rogue instance."""
    router = await env.nc("router")
    seen: list[str] = []
    watch = asyncio.create_task(watch_kv(router.jetstream(), S.instances_bucket, lambda k, v: seen.append(k),
                                         nc=router))
    try:
        for who in ("instance-b", "client", "gateway", "estimator", "predictor", "calibrator", "router"):
            nc = await env.nc(who)
            for key in ("a", "rogue"):  # a put is a publish to $KV.<bucket>.<key> (what kv.put sends)
                await _publish(nc, f"$KV.{S.instances_bucket}.{key}", b"rogue", reply=nc.new_inbox())
        own = await env.nc("instance-a")
        kv = await ensure_kv(own.jetstream(timeout=1.0), S.instances_bucket)
        await kv.put("a", b"genuine")  # the instance itself may
        admin = await env.nc("admin")  # control: the same raw publish does write when allowed
        await _publish(admin, f"$KV.{S.instances_bucket}.control", b"x", reply=admin.new_inbox())
        # the control write comes after every rogue one (each flushed first): once it is seen, a
        # rogue write that got through would have been seen before it
        await wait_until(lambda: "control" in seen, what="the control write in the router's watch")
    finally:
        watch.cancel()
    assert seen == ["a", "control"]
    entry = await (await admin.jetstream().key_value(S.instances_bucket)).get("a")
    assert entry.value == b"genuine"


@pytest.mark.parametrize("subject", [S.snapshot("a"), S.delta("a"), S.batches("a"), S.dispatch("a"), S.outcome("a"),
                                     f"$KV.{S.calibration_bucket}.a"])
async def test_forging_another_instances_messages_is_refused(env: Env, subject: str) -> None:
    admin = await env.nc("admin")
    forgers = ["instance-b", "client", "gateway", "predictor", "estimator"]
    if not subject.startswith(("bear.dispatch", "bear.outcome")):
        forgers.append("router")
    ncs = [await env.nc(w) for w in forgers]

    async def act() -> None:
        for nc in ncs:
            await _publish(nc, subject)

    assert await _received(admin, subject, act) == []


async def test_an_instance_publishes_its_own_state(env: Env) -> None:
    admin = await env.nc("admin")
    own = await env.nc("instance-a")
    got = await _received(admin, "bear.>", lambda: _publish(own, S.snapshot("a")), expect=1)
    assert {m.subject for m in got} == {S.snapshot("a")}
    got = await _received(admin, "bear.>", lambda: _publish(own, S.batches("a")), expect=1)
    assert {m.subject for m in got} == {S.batches("a")}
    got = await _received(admin, "bear.>", lambda: _publish(own, S.delta("a")), expect=1)
    assert {m.subject for m in got} == {S.delta("a")}


async def test_an_estimator_asks_an_instance_to_resync(env: Env) -> None:
    """bear.resync.<id>: an estimator may ask, the instance itself answers (response permission);
    another instance cannot take its requests."""
    own = await env.nc("instance-a")
    other = await env.nc("instance-b")
    estimator = await env.nc("estimator")
    stolen: list[Any] = []

    async def answer(msg: Any) -> None:
        await msg.respond(b"full state")

    async def steal(msg: Any) -> None:
        stolen.append(msg)

    await own.subscribe(S.resync("a"), cb=answer)
    steal_sub = None
    with contextlib.suppress(Exception):
        steal_sub = await other.subscribe(S.resync("a"), cb=steal)
    await own.flush()
    await other.flush()  # its subscription (if the server took it) is in place before the request
    reply = await estimator.request(S.resync("a"), b"resync", timeout=5.0)
    if steal_sub is not None:  # the request was routed before it was answered: a copy would be here now
        await _settled(other, steal_sub)
    assert reply.data == b"full state" and stolen == []


async def test_inboxes_are_private(env: Env) -> None:
    """A client's answer reaches only that client: nobody else may subscribe to its inbox, and
    nobody but a router may publish into it (the predictor and the estimator only answer requests
    they were sent)."""
    client = await env.nc("client")
    router = await env.nc("router")
    answered = asyncio.Event()

    async def serve(msg: Any) -> None:
        for k in range(5):  # a streamed answer: many responses to one submit
            await router.publish(msg.reply, b"chunk %d" % k)
        await router.flush()
        answered.set()

    await router.subscribe(S.submit_all, queue="bear-router", cb=serve)
    await router.flush()
    snoopers = [await env.nc(w) for w in ("gateway", "estimator", "predictor", "calibrator", "instance-a")]
    snooped: list[Any] = []

    async def snoop(msg: Any) -> None:
        snooped.append(msg)

    snoop_subs: list[tuple[Any, Any]] = []
    for nc in snoopers:
        for pattern in ("_INBOX.>", "_INBOX_client.>", ">"):
            with contextlib.suppress(Exception):
                snoop_subs.append((nc, await nc.subscribe(pattern, cb=snoop)))
        await nc.flush()
    inbox = client.new_inbox()
    assert inbox.startswith("_INBOX_client.")
    sub = await client.subscribe(inbox)
    await client.publish(S.submit_as("client"), b"query", reply=inbox)  # its own submit subject
    await asyncio.wait_for(answered.wait(), HANG_S)
    for nc in snoopers:  # injection: publishing straight into the client's inbox
        await _publish(nc, inbox, b"forged answer")
    await client.flush()  # everything routed to the client by now (the chunks, any forgery) is queued
    got = [(await sub.next_msg(timeout=HANG_S)).data for _ in range(sub.pending_msgs)]
    assert got == [b"chunk %d" % k for k in range(5)]
    for nc, s in snoop_subs:
        await _settled(nc, s)
    assert snooped == []


async def test_streams_cannot_be_deleted_or_purged(env: Env) -> None:
    """Nobody but admin deletes, purges or reconfigures a bucket (deleting the dedup stream used
    to allow a second execution of a query id)."""
    for who in ("router", "client", "gateway", "estimator", "predictor", "calibrator", "instance-a"):
        nc = await env.nc(who)
        for op in ("STREAM.DELETE", "STREAM.PURGE", "STREAM.UPDATE", "STREAM.CREATE"):
            for bucket in (S.queries_bucket, S.instances_bucket, S.calibration_bucket):
                body = b'{"name": "KV_%s", "subjects": ["x"]}' % bucket.encode() if op != "STREAM.PURGE" else b"{}"
                await _publish(nc, f"$JS.API.{op}.KV_{bucket}", body, reply=nc.new_inbox())
    admin = await env.nc("admin")
    js = admin.jetstream()
    await ensure_kv(js, "scratch")  # control: the same raw request deletes when allowed
    await _publish(admin, "$JS.API.STREAM.DELETE.KV_scratch", b"", reply=admin.new_inbox())

    async def scratch_gone() -> bool:  # the control request, sent after every refused one, is done
        return "KV_scratch" not in [i.config.name for i in await js.streams_info()]

    await wait_until(scratch_gone, what="the control deletion of KV_scratch")
    for bucket in (S.queries_bucket, S.instances_bucket, S.calibration_bucket):
        info = await js.stream_info(f"KV_{bucket}")
        assert info.config.name == f"KV_{bucket}"
    assert (await js.stream_info(f"KV_{S.queries_bucket}")).config.max_age == pytest.approx(600.0)


async def test_each_part_can_do_its_job(env: Env) -> None:
    """The positive side: the rights in the table suffice (a missing one would break BEAR with
    auth on, which the stack tests also run)."""
    from nats import micro

    predictor = await env.nc("predictor")
    svc = await micro.add_service(predictor, name="bear-predictor", version="0.1.0")

    async def handle(req: Any) -> None:
        await req.respond(b"prediction")

    await svc.add_endpoint(name="predict", subject=S.predict, handler=handle, queue_group="bear-predictor")
    router = await env.nc("router")
    assert (await router.request(S.predict, b"q", timeout=2.0)).data == b"prediction"
    # ... but only as an answer: publishing into the router's (or a client's) inbox unasked is refused
    got = await _received(router, "_INBOX_router.>", lambda: _publish(predictor, "_INBOX_router.x", b"forged"))
    assert got == []
    admin = await env.nc("admin")
    assert (await admin.request("$SRV.PING.bear-predictor", b"", timeout=2.0)).data
    # the router's dedup: create-only claims of query ids
    kv = await ensure_kv(router.jetstream(timeout=2.0), S.queries_bucket)
    await kv.create("q1", b"router")
    with pytest.raises(Exception, match="wrong last sequence"):
        await kv.create("q1", b"again")
    # the calibrator publishes a fit; estimators and routers follow both buckets
    cal = await env.nc("calibrator")
    await (await ensure_kv(cal.jetstream(timeout=2.0), S.calibration_bucket)).put("a", b"fit")
    inst = await env.nc("instance-a")
    await (await ensure_kv(inst.jetstream(timeout=2.0), S.instances_bucket)).put("a", b"rec")
    for who, bucket in (("estimator", S.calibration_bucket), ("estimator", S.instances_bucket),
                        ("router", S.calibration_bucket), ("gateway", S.instances_bucket)):
        nc = await env.nc(who)
        seen: list[str] = []
        loaded = asyncio.Event()
        task = asyncio.create_task(watch_kv(nc.jetstream(), bucket, lambda k, v, seen=seen: seen.append(k),
                                            on_loaded=loaded.set, nc=nc))
        try:
            await asyncio.wait_for(loaded.wait(), HANG_S)
        finally:
            task.cancel()
        assert seen == ["a"], (who, bucket)
    await svc.stop()


async def test_prefix_cache_events_and_tokenizer_bundles(env: Env) -> None:
    """Issue 15's subjects under the same rules: an instance publishes only its own prefix-cache
    events and hears only its own resync requests; estimators follow every instance's events and
    ask for resyncs; an instance stores its tokenizer bundle and a router fetches it; a bundle forged
    under another's id is refused by the reader."""
    from bear.tokenizer.bundle import TokenizerBundle
    from bear.tokenizer.store import get_bundle, put_bundle

    est = await env.nc("estimator")
    inst_a, inst_b = await env.nc("instance-a"), await env.nc("instance-b")
    got = await _received(est, S.kv_all, lambda: _publish(inst_a, S.kv("a")), expect=1)
    assert {m.subject for m in got} == {S.kv("a")}
    assert await _received(est, S.kv_all, lambda: _publish(inst_b, S.kv("a"))) == []  # forging a's events
    got = await _received(inst_a, S.kv_resync("a"), lambda: _publish(est, S.kv_resync("a")), expect=1)
    assert got
    for nc in (inst_b, await env.nc("router"), await env.nc("client")):  # nobody else listens to a's resyncs
        with contextlib.suppress(Exception):
            await nc.subscribe(S.kv_resync("a"))
        await nc.flush()
    admin = await env.nc("admin")
    got = await _received(admin, S.kv_resync("a"), lambda: _publish(inst_b, S.kv_resync("a")))
    assert got == []  # an instance may not ask another for a resync

    bundle = TokenizerBundle(b'{"model": {}}', None, {})
    bid = await put_bundle(inst_a.jetstream(timeout=3.0), S.tokenizers_bucket, bundle, "a")  # its own name
    router = await env.nc("router")
    fetched = await get_bundle(router.jetstream(timeout=3.0), S.tokenizers_bucket, bid, ["a"])
    assert fetched is not None and fetched.id == bid
    # instance b stores other content under its own name and claims a's bundle id: the reader refuses it
    obs = await inst_b.jetstream(timeout=3.0).object_store(S.tokenizers_bucket)
    await obs.put("b", TokenizerBundle(b'{"model": {"forged": 1}}', None, {}).to_bytes())
    assert await get_bundle(router.jetstream(timeout=3.0), S.tokenizers_bucket, bid, ["b"]) is None
    # (writing under a's name is refused: tests/security/test_store_limits.py)


# ----------------------------------------------------------------------------- issue 40, item 3
async def _serve_in_group(nc: Any, subject: str, queue: str, got: list[bytes]) -> Any:
    """A queue member that answers (and records) every request it is handed."""
    async def answer(msg: Any) -> None:
        got.append(msg.data)
        await msg.respond(b"answer")

    sub = await nc.subscribe(subject, queue=queue, cb=answer)
    await nc.flush()
    return sub


@pytest.mark.parametrize(("who", "subject", "group"), [
    ("predictor", S.predict, PREDICTOR_QUEUE), ("estimator", S.estimate, ESTIMATOR_QUEUE),
    ("estimator", S.estimate_shard(2, 4), ESTIMATOR_QUEUE)])
async def test_a_service_takes_its_requests_only_in_its_queue_group(env: Env, who: str, subject: str,
                                                                    group: str) -> None:
    """A leaked predictor or estimator credential that subscribes outside its queue group — a plain
    subscription, a wildcard one, or its own group (which gets a copy of everything) — gets no
    request; in the service's group the same identity is served its requests."""
    genuine = await env.nc(who)
    served: list[bytes] = []
    await _serve_in_group(genuine, subject, group, served)
    leak = await env.nc(who)
    copies: list[Any] = []

    async def copy(msg: Any) -> None:
        copies.append(msg)

    stolen = []
    for pattern, queue in ((subject, ""), (">", ""), ("bear.*", ""), (f"{S.estimate}.*", ""), (subject, "rogue"),
                           (subject, f"{group}-2")):
        with contextlib.suppress(Exception):
            stolen.append(await leak.subscribe(pattern, queue=queue, cb=copy))
    await leak.flush()
    router = await env.nc("router")
    for k in range(5):
        assert (await router.request(subject, b"prompt %d" % k, timeout=HANG_S)).data == b"answer"
    await _settled(leak, *stolen)
    assert copies == [] and len(served) == 5


async def test_a_leaked_replica_sees_only_its_share(tmp_path: Path) -> None:
    """With 2 replicas, each its own identity: the leaked one (replica 0) is refused the plain
    subscription and, as a member of the queue group, is handed its requests only — every request
    goes to exactly one member, so what it sees and answers is a split with the genuine replica,
    never all of them (and never a copy of the genuine one's)."""
    files = generate(tmp_path / "auth", [], replicas={"predictor": 2, "estimator": 2})
    assert {"predictor-0", "predictor-1", "estimator-0", "estimator-1"} <= set(files.creds)
    assert "predictor" not in files.creds and "estimator" not in files.creds
    with LocalNatsServer(config=files.config) as srv:
        e = Env(srv, files)
        try:
            router = await e.nc("router")
            for svc, subject, group in (("predictor", S.predict, PREDICTOR_QUEUE),
                                        ("estimator", S.estimate, ESTIMATOR_QUEUE)):
                genuine, leaked = await e.nc(f"{svc}-1"), await e.nc(f"{svc}-0")
                seen_plain: list[Any] = []

                async def plain(msg: Any, into: list[Any] = seen_plain) -> None:
                    into.append(msg)

                plain_sub = await leaked.subscribe(subject, cb=plain)
                by_genuine: list[bytes] = []
                by_leak: list[bytes] = []
                await _serve_in_group(genuine, subject, group, by_genuine)
                leak_sub = await _serve_in_group(leaked, subject, group, by_leak)
                n = 40
                for k in range(n):
                    assert (await router.request(subject, b"prompt %d" % k, timeout=HANG_S)).data == b"answer"
                await _settled(leaked, plain_sub, leak_sub)
                assert seen_plain == []  # the plain subscription was refused
                assert len(by_leak) + len(by_genuine) == n  # each request to one member: no copies
                assert set(by_leak).isdisjoint(by_genuine)
                assert 0 < len(by_leak) < n  # a split (2^-39 odds of one member getting all 40)
        finally:
            await e.close()


async def test_revoking_a_replica_ends_it_alone(tmp_path: Path) -> None:
    """``revoke`` + a configuration reload closes the leaked replica's connections and refuses
    its credential from then on; the other replica keeps serving."""
    files = generate(tmp_path / "auth", [], replicas={"predictor": 2})
    with LocalNatsServer(config=files.config) as srv:
        e = Env(srv, files)
        try:
            leaked_file = files.path("predictor-0")
            leaked_copy = tmp_path / "leaked.json"  # what the attacker holds
            leaked_copy.write_bytes(leaked_file.read_bytes())
            leaked = await e.nc("predictor-0")
            genuine = await e.nc("predictor-1")
            by_genuine: list[bytes] = []
            await _serve_in_group(genuine, S.predict, PREDICTOR_QUEUE, by_genuine)
            assert revoke(files, ["predictor-0"]) == ["predictor-0"]
            assert "predictor-0" not in files.creds and not leaked_file.exists()
            srv.reload()
            await wait_until(lambda: not leaked.is_connected, what="the revoked replica's connection closed")
            with pytest.raises(BearError, match="authorization violation"):
                await connect(srv.url, "leaked-again", creds=leaked_copy, connect_within_s=2.0)
            router = await e.nc("router")
            assert (await router.request(S.predict, b"q", timeout=HANG_S)).data == b"answer"
            assert genuine.is_connected and by_genuine == [b"q"]
        finally:
            await e.close()
