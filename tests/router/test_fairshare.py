"""Fair shares between identities (issue 40, item 4): the pure admission rule (bear.router.fairshare
through bear.router.admission), and once through a router: the flooder is refused first, an
identity under its share is never refused for the load others make."""

from __future__ import annotations

import asyncio
import random
import time

import nats

from bear.client.submit import submit
from bear.protocol.errors import ErrorCode
from bear.router.admission import Admission
from bear.router.fairshare import HARD_FACTOR, TENANT_HEADER, FairShare, Shares, identity_of
from bear.router.service import RouterConfig, RouterService

from fake_engine import FakeEngine, register
from waiting import wait_until


async def _collect(nc, **kw) -> list[dict]:  # type: ignore[no-untyped-def]
    return [m async for m in submit(nc, "hello there", **kw)]


def test_alone_an_identity_is_refused_where_the_router_refused_before() -> None:
    a = Admission(max_inflight=4, max_deciding=100, shed_lag_s=1.0)
    now = time.time()
    for _ in range(4):
        assert a.refuse(a.fair.total, None, now, "solo") is None
        a.fair.add("solo")
    r = a.refuse(a.fair.total, None, now, "solo")
    assert r is not None and r.code == ErrorCode.OVERLOADED and r.reason == "max_inflight"


def test_the_flooder_is_refused_first_and_the_light_identity_never_while_under_its_share() -> None:
    """Capacity C, a flooder that submits whenever it can and a light identity that submits now and
    then; queries end at random. Every refusal under pressure goes to an identity at or over its
    share; the light identity, under its share whenever it submits, is never refused; the queries
    in progress stay below 2C."""
    rng = random.Random(7)
    C = 20
    a = Admission(max_inflight=C, max_deciding=10_000, shed_lag_s=1.0)
    now = time.time()
    held: list[str] = []
    refused = {"flood": 0, "light": 0}
    light_under_share_refused = 0
    for step in range(20_000):
        who = "light" if step % 10 == 0 else "flood"
        under = a.fair.within_share(who)
        r = a.refuse(a.fair.total, None, now, who)
        if r is None:
            a.fair.add(who)
            held.append(who)
        else:
            refused[who] += 1
            assert r.reason == "max_inflight"
            assert not under, "an identity under its share was refused"
            if who == "light" and under:
                light_under_share_refused += 1
        assert a.fair.total < HARD_FACTOR * C
        if held and rng.random() < 0.45:  # one query ends
            a.fair.remove(held.pop(rng.randrange(len(held))))
    assert refused["flood"] > 1000 and refused["light"] == 0 and light_under_share_refused == 0


def test_weights_divide_the_shares_and_limits_hold_whatever_the_load() -> None:
    f = FairShare(Shares(weights={"big": 3.0}, limits={"capped": 2}))
    for _ in range(6):
        f.add("big")
    for _ in range(2):
        f.add("small")
    assert f.share("big") == 8 * 3 / 4 and f.share("small") == 8 * 1 / 4
    assert f.within_share("big") is False and f.within_share("small") is False  # 6 of 6, 2 of 2
    assert f.within_share("newcomer")  # holds nothing: under any share
    assert f.verdict("capped", None, 100) is None
    f.add("capped")
    f.add("capped")
    assert f.verdict("capped", None, 100) == "identity_limit"  # no pressure at all, still its limit
    assert f.verdict("big", "loop_lag", 100) == "loop_lag" and f.verdict("newcomer", "loop_lag", 100) is None
    for who in ("big",) * 6 + ("small",) * 2 + ("capped",) * 2:
        f.remove(who)
    assert f.total == 0 and f.inflight == {} and f.share("x") == 0.0
    f.remove("never-added")  # harmless
    assert f.total == 0


def test_every_pressure_refuses_the_identity_over_its_share_only() -> None:
    a = Admission(max_inflight=1000, max_deciding=5, shed_lag_s=0.1)
    now = time.time()
    for _ in range(9):
        a.fair.add("flood")
    a.fair.add("light")
    a.lag = 0.5
    assert a.refuse(10, None, now, "flood").reason == "loop_lag"
    assert a.refuse(10, None, now, "light") is None
    a.lag, a.deciding = 0.0, 5
    assert a.refuse(10, None, now, "flood").reason == "max_deciding"
    assert a.refuse(10, None, now, "light") is None
    a.deciding = 0
    assert a.refuse(10, None, now, "flood") is None  # no pressure: everyone is taken
    assert a.refuse(10, now - 1, now, "light").code == ErrorCode.DEADLINE_EXCEEDED  # an expired one never


def test_the_tenant_header_counts_only_from_a_trusted_relay() -> None:
    h = {TENANT_HEADER: "0123abcd"}
    assert identity_of("gateway", h) == "gateway/0123abcd"
    assert identity_of("alice", h) == "alice"  # a client cannot pose as someone else's tenant
    assert identity_of("gateway", None) == "gateway"
    assert identity_of("gateway", {TENANT_HEADER: "x\n" + "y" * 200}, ("gateway",)) == "gateway/x" + "y" * 62  # cut, then unprintables dropped
    assert identity_of("proxy", h, ("proxy",)) == "proxy/0123abcd"


async def test_through_a_router_the_flooder_is_refused_and_the_light_identity_taken(nats_server, tmp_path) -> None:
    inst = await FakeEngine(tokens=1, held=True).start()
    admin = await nats.connect(nats_server.url)
    flood = await nats.connect(nats_server.url, inbox_prefix="_INBOX_flood")
    light = await nats.connect(nats_server.url, inbox_prefix="_INBOX_light")
    await register(admin, "held", "m/held", inst.port, backend="vllm")
    router = RouterService(admin, RouterConfig(predict_budget_s=0.05, predict_try_s=0.025, estimate_budget_s=0.05,
                                               estimate_try_s=0.025, outcome_log=tmp_path / "out.jsonl",
                                               max_inflight=4, sequence=False))
    await router.start()
    await wait_until(lambda: [i.id for i in router.registry.healthy()] == ["held"], what="registered")
    try:
        kw = {"ttft_target_s": 1.0, "max_tokens": 1, "accept_timeout_s": 30.0}
        floods = [asyncio.create_task(_collect(flood, query_id=f"f{k}", **kw)) for k in range(4)]
        await wait_until(lambda: router.admission.fair.inflight.get("flood") == 4, what="4 flood queries taken")
        refused = await _collect(flood, query_id="f-over", **kw)
        assert refused[-1]["v"] == "bear.error/1" and refused[-1]["error"]["code"] == "overloaded"
        assert "flood" in refused[-1]["error"]["message"]
        lights = [asyncio.create_task(_collect(light, query_id=f"l{k}", **kw)) for k in range(2)]
        await wait_until(lambda: router.admission.fair.inflight.get("light") == 2, what="2 light queries taken")
        inst.release.set()
        for msgs in await asyncio.gather(*floods, *lights):
            assert msgs[-1]["v"] == "bear.done/1", msgs[-1]
        await wait_until(lambda: router.admission.fair.total == 0, what="every query ended")
    finally:
        inst.release.set()
        await router.stop()
        await inst.stop()
        for nc in (admin, flood, light):
            await nc.close()


def test_the_router_options_parse_identities_and_refuse_bad_values() -> None:
    import pytest
    import typer

    from bear.commands.router import _per_identity

    assert _per_identity(["alice=2", "gateway/0123=0.5", "*=3"], "--identity-weight", float, 1e-9) == {
        "alice": 2.0, "gateway/0123": 0.5, "*": 3.0}
    assert _per_identity(["bob=0"], "--identity-limit", int, 0) == {"bob": 0}
    for bad in ("alice", "=2", "alice=x", "alice=-1", "alice=nan"):
        with pytest.raises(typer.BadParameter):
            _per_identity([bad], "--identity-weight", float, 1e-9)
    with pytest.raises(typer.BadParameter):
        _per_identity(["bob=1.5"], "--identity-limit", int, 0)


def test_the_gateway_names_each_api_key_by_a_tag_never_the_key() -> None:
    import hashlib
    from types import SimpleNamespace

    from bear.gateway.auth import ApiKeys
    from bear.gateway.server import Gateway

    key = "bear-secret-key"
    tag = ApiKeys.tenant(f"Bearer {key}")
    assert tag == hashlib.sha256(key.encode()).hexdigest()[:16] and key not in tag
    assert ApiKeys.tenant(None) == "" and ApiKeys.tenant("Bearer ") == ""
    gw = SimpleNamespace(keys=ApiKeys([key]))
    req = SimpleNamespace(headers={"Authorization": f"Bearer {key}"})
    assert Gateway._tenant(gw, req, {"traceparent": "t"}) == {"traceparent": "t", TENANT_HEADER: tag}  # type: ignore[arg-type]
    assert Gateway._tenant(SimpleNamespace(keys=None), req, None) is None  # type: ignore[arg-type]
    assert identity_of("gateway", {TENANT_HEADER: tag}) == f"gateway/{tag}"
