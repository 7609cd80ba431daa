"""Issue 26, item 1, against a real nats-server with ``bear up``'s credentials and a real router:
a leaked instance credential re-registered its own instance as Qwen/Qwen3-32B at price 0 at an
attacker's address; the router sent it prompts, its clients got forged answers and the engine's
API key went there too. With provisioning (bindings in ``bear_provisioned``, which only admin
writes) the router takes no entry that differs from its binding: nothing reaches the attacker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from secured_pool import MODEL, S, publish_quietly, secured_pool

from bear.client.submit import submit
from bear.protocol.codec import pack
from bear.router.registry import InstanceInfo

from waiting import wait_until

CLIENTS = ("client", "gateway")
QUERIES = 20


async def _bind(admin: Any, bindings: dict[str, tuple[str, float, float]]) -> None:
    """What ``bear up`` / ``bear nats provision`` write as admin: instance → (base URL, prices)."""
    kv = await admin.jetstream(timeout=5.0).key_value(S.provisioned_bucket)
    for inst, (url, pin, pout) in bindings.items():
        await kv.put(inst, pack({"v": "bear.provisioned/1", "id": inst, "model": MODEL, "base_url": url,
                                 "prices": {"input_per_mtok": pin, "output_per_mtok": pout}}))


async def test_a_leaked_instance_credential_cannot_move_its_instance(tmp_path: Path) -> None:
    async with secured_pool(tmp_path, ["a", "b", "c"], CLIENTS) as pool:
        a, b, evil = await pool.engine("a"), await pool.engine("b"), await pool.engine("evil")
        admin = await pool.nc("admin")
        await _bind(admin, {"a": (a.url, 0.1, 0.2), "b": (b.url, 0.3, 0.6)})
        await pool.register("a", a.url, price_in=0.1, price_out=0.2)
        await pool.register("b", b.url, price_in=0.3, price_out=0.6)
        router = await pool.router({"a": "key-a", "b": "key-b", "c": "key-c"}, provisioning=True)
        await wait_until(lambda: len(router.registry.healthy()) == 2, what="instances a and b registered")
        # the attack: instance b's own credential re-registers b — another model, free, elsewhere —
        # while the genuine b keeps registering too; and c, which has no binding, registers at all
        await pool.register("b", evil.url, model="Qwen/Qwen3-32B", price_in=0.0, price_out=0.0)
        await pool.register("c", evil.url, model="Qwen/Qwen3-32B", price_in=0.0, price_out=0.0)
        await wait_until(lambda: (router.registry.rejected.get("mismatch", 0) > 0
                                  or router.registry.get("b").base_url == evil.url)
                         and (router.registry.rejected.get("unprovisioned", 0) > 0 or "c" in router.registry.instances),
                         what="the router to see the rogue entries of b and c")
        client = await pool.nc("client")
        answers: list[str] = []
        for k in range(QUERIES):
            got = [m async for m in submit(client, f"question {k}", query_id=f"q{k}", ttft_target_s=5.0, max_tokens=2,
                                           accept_timeout_s=5.0, resubmits=0)]
            assert got[-1]["v"] == "bear.done/1", got
            answers.append("".join(m.get("text", "") for m in got))
        forged = [t for t in answers if t.startswith("evil:")]
        keys_leaked = [h for _, h in evil.requests if "key-" in h]
        print(f"item 1: {len(evil.requests)} of {QUERIES} prompts went to the attacker, {len(forged)} forged answers "
              f"reached the client, {len(keys_leaked)} engine keys sent there; rejected {router.registry.rejected}")
        assert evil.requests == [] and forged == [] and keys_leaked == []
        assert all(t.startswith(("a:", "b:")) for t in answers)
        assert router.registry.rejected.get("mismatch", 0) > 0 and router.registry.rejected.get("unprovisioned", 0) > 0
        assert "c" not in router.registry.instances and router.registry.get("b").base_url == b.url
        # engine keys went only where each instance was provisioned
        assert {h for _, h in a.requests} <= {"Bearer key-a"} and {h for _, h in b.requests} <= {"Bearer key-b"}


async def test_only_admin_writes_the_bindings(tmp_path: Path) -> None:
    """The bindings are admin's word: no service, client or instance identity may write them."""
    async with secured_pool(tmp_path, ["a"], CLIENTS) as pool:
        admin = await pool.nc("admin")
        kv = await admin.jetstream(timeout=5.0).key_value(S.provisioned_bucket)
        for who in ("instance-a", "router", "client", "gateway", "estimator", "predictor", "calibrator"):
            nc = await pool.nc(who)  # a put is a publish to $KV.<bucket>.<key> (flushed: processed by the server)
            await publish_quietly(nc, f"$KV.{S.provisioned_bucket}.a", b"rogue", reply=nc.new_inbox())
        await _bind(admin, {"control": ("http://127.0.0.1:1/v1", 0.0, 0.0)})  # the same put, allowed
        keys = set(await kv.keys())
        assert keys == {"control"}


async def test_a_binding_that_changes_judges_its_entry_again(tmp_path: Path) -> None:
    """An entry that waited for its binding is taken when admin writes it; a binding changed to
    another address drops the instance until its entry agrees."""
    async with secured_pool(tmp_path, ["a"], CLIENTS) as pool:
        a = await pool.engine("a")
        router = await pool.router({"a": "key-a"}, provisioning=True)
        await pool.register("a", a.url)
        await wait_until(lambda: router.registry.rejected.get("unprovisioned", 0) > 0, what="a refused: no binding")
        admin = await pool.nc("admin")
        await _bind(admin, {"a": (a.url, 0.1, 0.2)})
        await wait_until(lambda: len(router.registry.healthy()) == 1, what="a taken once bound")
        await _bind(admin, {"a": ("http://10.0.0.1:8000/v1", 0.1, 0.2)})
        await wait_until(lambda: "a" not in router.registry.instances, what="a dropped: its binding moved")
        assert not router.registry.engine_key_allowed(InstanceInfo("a", base_url=a.url))  # no key to the old address


def test_bear_up_binds_what_it_starts_and_gives_each_client_its_identity(tmp_path: Path) -> None:
    """``bear up`` (auth on) binds each instance it starts to exactly what that instance registers,
    hands its routers --provisioning and its own base-URL allow-list, and makes one identity per
    client (``--client``), each with its own inbox prefix."""
    from bear.instance.record import instance_record
    from bear.protocol.provisioned import mismatch
    from bear.runtime.identity import load_identity
    from bear.runtime.nats_server import LocalNatsServer
    from bear.sim.profile import load_profile
    from bear.stack.stack import Stack, StackConfig

    st = Stack(StackConfig(workdir=tmp_path, predictor_dir=tmp_path, clients=("alice", "bob")))
    st.run_dir.mkdir(parents=True)
    st.plan()
    st.nats = LocalNatsServer()  # not started: only its existence says "the local server" to _set_up_auth
    st._set_up_auth()
    assert st.auth is not None
    idents = {n: load_identity(st.auth.path(n)) for n in ("client", "gateway", "alice", "bob")}
    assert len({i.public_key for i in idents.values()}) == 4
    assert {n: i.inbox_prefix for n, i in idents.items()} == {n: f"_INBOX_{n}" for n in idents}
    argv = st.children["router-0"].argv
    assert "--provisioning" in argv
    allowed = [argv[k + 1] for k, a in enumerate(argv) if a == "--allow-base-url"]
    assert sorted(allowed) == sorted(f"http://127.0.0.1:{p}/v1" for p in st.instances.values())
    by_id = {b.id: b for b in st.bindings}
    assert set(by_id) == set(st.instances)
    for inst, prof_name in zip(st.instances, ("qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100-tp2"), strict=True):
        prof = load_profile(prof_name)  # what bear sim-engine --profile registers (bear.sim.run)
        rec = instance_record(inst, prof.model, f"http://127.0.0.1:{st.instances[inst]}/v1", backend="sim",
                              price_input_per_mtok=prof.prices.get("input_per_mtok", 0.0),
                              price_output_per_mtok=prof.prices.get("output_per_mtok", 0.0),
                              config=prof.engine_config())
        assert mismatch(by_id[inst], rec) == "", inst


def test_provision_instances_file_is_checked(tmp_path: Path) -> None:
    """``bear nats provision --instances FILE``: each binding validated (id a subject token,
    prices ≥ 0, model and base URL present); anything wrong is one error naming the instance."""
    import json

    import pytest
    import typer

    from bear.commands.nats import _bindings

    good = tmp_path / "good.json"
    good.write_text(json.dumps({"a": {"model": MODEL, "base_url": "http://10.0.0.5:8000/v1/",
                                      "price_input_per_mtok": 0.1, "price_output_per_mtok": 0.2,
                                      "max_model_len": 40960}}))
    [b] = _bindings(good)
    assert (b.id, b.model, b.base_url, b.prices.output_per_mtok, b.max_model_len) == (
        "a", MODEL, "http://10.0.0.5:8000/v1", 0.2, 40960)
    for bad in ({"a.b": {"model": "m", "base_url": "u"}}, {"a": {"model": "m"}},
                {"a": {"model": "m", "base_url": "u", "price_input_per_mtok": -1}}, ["a"]):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(typer.BadParameter):
            _bindings(path)
