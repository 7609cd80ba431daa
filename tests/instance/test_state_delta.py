"""bear.delta/1: the publisher's encoder and libbea's applier agree — the mirror equals the full
state after every step of the libbea engine under many configurations (FCFS and priority queues,
KV pressure with preemptions, prefix caching, no chunked prefill, aborts, coalesced steps); async
states with an in-flight batch; malformed and misdirected deltas are refused without corrupting
anything; the publisher's stream (full snapshots every N, resync answers, rate limit)."""

from __future__ import annotations

import asyncio
import itertools
import random
import zlib
from typing import Any

import msgspec
import pytest

from bear import libbea
from bear.instance.delta import StateStream, encode_delta
from bear.instance.publisher import InstancePublisher
from bear.protocol.codec import pack, unpack_map
from bear.protocol.messages import ResyncRequest, encode
from bear.protocol.subjects import DELTA_SCHEMA
from bear.sim.profile import load_profile

BASE = load_profile("qwen3-8b-h100").engine_config()
CONFIGS: dict[str, dict[str, Any]] = {
    "fcfs": {"num_gpu_blocks": 4000, "max_num_seqs": 64},
    "kv-pressure": {"num_gpu_blocks": 160, "max_num_seqs": 32, "max_num_batched_tokens": 1024},
    "prefix-caching": {"num_gpu_blocks": 300, "max_num_seqs": 32, "enable_prefix_caching": True},
    "no-chunking": {"num_gpu_blocks": 600, "max_num_seqs": 16, "enable_chunked_prefill": False,
                    "max_num_batched_tokens": 4096},
    "lpt": {"num_gpu_blocks": 800, "max_num_seqs": 24, "long_prefill_token_threshold": 256,
            "max_num_batched_tokens": 1024},
    "priority": {"num_gpu_blocks": 160, "max_num_seqs": 24, "policy": "priority", "max_num_batched_tokens": 1024},
}  # fmt: skip


def engine_states(config: str, steps: int, seed: int, generation: int = 7) -> list[dict[str, Any]]:
    """The initial state and the published state after every step of a random workload (bursts,
    aborts, idle gaps)."""
    rng = random.Random(seed)
    cfg = {**BASE, **CONFIGS[config]}
    e = libbea.Engine(cfg)
    longest = min(2500, cfg["num_gpu_blocks"] * cfg["block_size"] // 3)  # every prompt fits the KV cache
    out = [dict(e.snapshot("i", "m", 0.0), generation=generation)]
    n = 0
    for step in range(steps):
        for _ in range(rng.choice([0, 0, 0, 0, 0, 0, 1, 2]) if step % 200 < 140 else 0):
            n += 1
            e.add(f"r{n}", rng.randint(5, longest), rng.randint(1, 120), rng.randint(1, 120), float(step),
                  rng.randint(-2, 2))
        if n and rng.random() < 0.03:
            e.abort(f"r{rng.randint(1, n)}")
        if e.has_work and e.step():
            e.finish_step()
        if e.seq != out[-1]["seq"]:  # a publisher sends a state after each step (aborts show in the next)
            out.append(dict(e.snapshot("i", "m", 0.5 * step), generation=generation))
    return out


def replay(states: list[dict[str, Any]], stride: int = 1) -> dict[str, int]:
    """Apply the delta of every ``stride``-th state to the mirror and compare with the full state."""
    mirror = libbea.Snapshot.from_msgpack(pack(states[0]))
    prev = states[0]
    res = {"deltas": 0, "full": 0, "bytes": 0, "full_bytes": 0, "preempted": 0, "admitted": 0, "removed": 0,
           "reordered": 0}
    for cur in states[stride::stride]:
        truth = libbea.Snapshot.from_msgpack(pack(cur))
        d = encode_delta(prev, cur)
        if d is None:
            res["full"] += 1
            mirror = truth
        else:
            raw = pack(d)
            res["deltas"] += 1
            res["bytes"] += len(raw)
            res["full_bytes"] += len(pack(cur))
            for k in ("preempted", "removed"):
                res[k] += len(d.get(k, ()))
            adm = d.get("admitted", 0)
            res["admitted"] += adm if isinstance(adm, int) else len(adm)
            res["reordered"] += "waiting_order" in d or isinstance(adm, list)
            mirror.apply_delta(libbea.Delta.from_msgpack(raw))
            diff = libbea.snapshot_difference(mirror, truth)
            assert diff is None, (cur["seq"], diff, d)
        prev = cur
    return res


@pytest.mark.parametrize("config", list(CONFIGS))
def test_mirror_equals_full_state_every_step(config: str) -> None:
    res = replay(engine_states(config, 800, seed=zlib.crc32(config.encode())))
    assert res["admitted"] > 0 and res["removed"] > 0 and res["full"] == 0, res
    if config in ("kv-pressure", "prefix-caching", "priority"):
        assert res["preempted"] > 0, res
    if config == "priority":
        assert res["reordered"] > 0, res
    assert res["bytes"] < 0.1 * res["full_bytes"], res


@pytest.mark.parametrize("stride", [3, 17])
def test_coalesced_states_chain_too(stride: int) -> None:
    """A publisher that coalesces (min interval) diffs against the last state it sent."""
    res = replay(engine_states("kv-pressure", 1200, seed=stride), stride=stride)
    assert res["deltas"] > 0 and res["full"] == 0, res


def test_async_states_with_inflight_batch_and_placeholders() -> None:
    states = engine_states("fcfs", 300, seed=5)
    rng = random.Random(1)
    for s in states[1:]:
        s["config"] = states[0]["config"] = {**s["config"], "async_scheduling": True}
        items = [{"id": r["id"], "n": 1, "context": r["computed_tokens"]} for r in s["running"]]
        items += [{"id": f"gone-{s['seq']}", "n": 3, "context": 40}] if rng.random() < 0.3 else []
        rng.shuffle(items)
        s["inflight"] = {"started": s["time"] - 0.01, "items": items}
        for r in s["running"]:
            r["placeholders"] = 1
            r["computed_tokens"] += 1
    res = replay(states)
    assert res["deltas"] == len(states) - 1


def test_a_state_is_named_by_generation_seq_and_time() -> None:
    """An engine's initial (empty) state and its first step share seq 0: a delta names its base by
    capture time too, so it never applies to the other one; and a step that does not advance seq
    gets no delta."""
    states = engine_states("fcfs", 20, seed=8)
    initial, first, second = states[0], states[1], states[2]
    assert encode_delta(initial, dict(first, seq=initial["seq"])) is None
    d = libbea.Delta.from_msgpack(pack(encode_delta(first, second)))
    other = libbea.Snapshot.from_dict(dict(first, time=first["time"] + 0.5))  # same seq, another state
    with pytest.raises(ValueError, match="another time"):
        other.apply_delta(d)
    assert not other.broken
    mine = libbea.Snapshot.from_dict(first)
    mine.apply_delta(d)
    assert libbea.snapshot_difference(mine, libbea.Snapshot.from_dict(second)) is None


def test_a_static_field_or_an_unknown_order_gets_a_full_snapshot() -> None:
    states = engine_states("fcfs", 80, seed=3)
    prev, cur = states[-2], states[-1]
    assert encode_delta(prev, cur) is not None
    cur2 = {**cur, "running": [dict(cur["running"][0], max_tokens=7), *cur["running"][1:]]}
    assert encode_delta(prev, cur2) is None
    cur3 = {**cur, "running": cur["running"][::-1]}
    assert len(cur["running"]) > 2 and encode_delta(prev, cur3) is None
    assert encode_delta(prev, {**cur, "generation": 8}) is None


def _valid_pair() -> tuple[bytes, dict[str, Any]]:
    states = engine_states("kv-pressure", 400, seed=11)
    for a, b in itertools.pairwise(states):
        d = encode_delta(a, b)
        if d and d.get("removed") and d.get("added") and d.get("set") and a["running"]:
            return pack(a), d
    raise AssertionError("no rich delta found")


def _mutate(rng: random.Random, d: dict[str, Any]) -> dict[str, Any]:
    d = msgspec.msgpack.decode(pack(d))
    key = rng.choice([k for k in d if k not in ("v", "instance")] + ["advance", "admitted", "inflight"])
    choice = rng.random()
    hostile = rng.choice([-1, 0, 1, 2**31, 2**62, -(2**40), 10**6, "x", None, [1, 2], {"a": 1}, 1.5])
    val = d.get(key)
    if isinstance(val, list) and val and choice < 0.6:
        val = list(val)
        val[rng.randrange(len(val))] = hostile if choice < 0.4 else (val[0] if choice < 0.5 else [])
        if choice >= 0.5:
            val.append(hostile)
        d[key] = val
    else:
        d[key] = hostile
    return d


def test_malformed_deltas_are_refused_and_break_only_the_mirror() -> None:
    """Random corruptions of a real delta: libbea applies it or raises ValueError (never a crash);
    a refused body marks the snapshot broken (no estimate from it); a delta for another state
    (generation, base seq and time) changes nothing."""
    base, good = _valid_pair()
    rng = random.Random(0)
    query = {"prompt_tokens": 100, "max_tokens": 10}
    outcomes = {"applied": 0, "refused": 0}
    for _ in range(3000):
        snap = libbea.Snapshot.from_msgpack(base)
        d = _mutate(rng, good)
        try:
            delta = libbea.Delta.from_msgpack(pack(d))
        except ValueError:
            outcomes["refused"] += 1
            continue
        try:
            snap.apply_delta(delta)
            outcomes["applied"] += 1
            libbea.estimate(snap, query)  # whatever it applied is a valid state
        except ValueError:
            outcomes["refused"] += 1
            if (delta.base, delta.base_time, delta.generation) == (snap.seq, snap.time, snap.generation):
                assert snap.broken
                with pytest.raises(ValueError, match="delta failed"):
                    libbea.estimate(snap, query)
            else:
                assert not snap.broken and libbea.snapshot_difference(
                    snap, libbea.Snapshot.from_msgpack(base)) is None
    assert outcomes["refused"] > 1000 and outcomes["applied"] > 100, outcomes
    for bad in (b"", b"\x81", pack([1, 2]), pack({"v": "bear.snapshot/1", "seq": 1, "base": 0}),
                pack({"v": DELTA_SCHEMA, "seq": 1}), pack({"v": DELTA_SCHEMA, "seq": 1, "base": 2, "base_time": 0}),
                pack({"v": DELTA_SCHEMA, "seq": 1, "base": 1, "base_time": 0}),
                pack({"v": DELTA_SCHEMA, "seq": 2, "base": 1})):
        with pytest.raises(ValueError):
            libbea.Delta.from_msgpack(bad)


def test_duplicate_arrival_ids_are_refused() -> None:
    base, good = _valid_pair()
    snap = libbea.Snapshot.from_msgpack(base)
    ids = snap.request_ids
    gone = {ids[p] for p in good["removed"]}
    kept = next(rid for rid in ids if rid not in gone)
    d = dict(good, added=[dict(good["added"][0], id=kept)])
    with pytest.raises(ValueError, match="duplicate"):
        snap.apply_delta(libbea.Delta.from_msgpack(pack(d)))
    # an id that left in the same delta may come back (a client reusing its request id)
    snap = libbea.Snapshot.from_msgpack(base)
    again = dict(good, added=[dict(good["added"][0], id=ids[good["removed"][0]])])
    assert snap.apply_delta(libbea.Delta.from_msgpack(pack(again))) == [ids[good["removed"][0]]]


def test_stream_full_every_n_and_on_request() -> None:
    states = engine_states("fcfs", 60, seed=2)
    s = StateStream(deltas=True, full_every=10)
    kinds = []
    for k, st in enumerate(states):
        if k == 25:
            s.want_full()
        full, delta = s.encode(st)
        kinds.append(("F" if full else "") + ("D" if delta else ""))
    fulls = [0, 10, 20, 25, *range(35, len(states), 10)]  # every 10 states, restarted by a request
    assert len(states) > 36 and [k for k, kind in enumerate(kinds) if kind != "D"] == fulls, kinds
    assert kinds[0] == "F" and {kinds[k] for k in fulls[1:]} == {"FD"}, kinds
    assert [k for k in StateStream(deltas=False).encode(states[1])] [1] is None


def test_resync_answer_rate_limit_and_errors() -> None:
    pub = InstancePublisher(None, "i", resync_per_s=2.0, generation=5)
    ask = encode(ResyncRequest(instance="i", consumer="t"))
    assert unpack_map(pub.resync_reply(ask))["error"]["code"] == "not_found"
    assert unpack_map(pub.resync_reply(b"\x00garbage"))["error"]["code"] == "bad_request"
    state = dict(engine_states("fcfs", 30, seed=4)[-1], generation=5)
    pub.stream.encode(state)
    got = [unpack_map(pub.resync_reply(ask)) for _ in range(4)]
    assert [("error" in g) for g in got] == [False, False, True, True]
    assert got[0]["seq"] == state["seq"] and got[0]["generation"] == 5
    assert got[2]["error"]["code"] == "overloaded"
    assert libbea.snapshot_difference(libbea.Snapshot.from_dict(got[0]), libbea.Snapshot.from_dict(state)) is None


class _YieldingNats:
    """A NATS client whose ``publish`` queues the message, then now and then yields to the event
    loop, as nats-py's does when its pending buffer is full (a loaded host): the interleaving that
    once sent a full snapshot after newer states while the deltas stayed in order."""

    is_connected = True

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append((subject.split(".")[1], unpack_map(payload)["seq"]))  # queued, in call order
        if len(self.sent) % 3 == 1:
            await asyncio.sleep(0)  # then a flush waits for the socket


def test_concurrent_publishers_send_states_in_order() -> None:
    """The snapshotter's reader and the publisher's loop both call ``publish_snapshots``: each
    subject still carries every state once, oldest first."""
    states = engine_states("kv-pressure", 120, seed=9)
    nc = _YieldingNats()
    pub = InstancePublisher(nc, "i", full_every=1)

    async def main() -> None:
        for st in states:
            pub.snapshot(dict(st))
        await asyncio.gather(*(pub.publish_snapshots() for _ in range(3)))

    asyncio.run(main())
    seqs = [st["seq"] for st in states]
    fulls = [seq for kind, seq in nc.sent if kind == "snapshot"]
    deltas = [seq for kind, seq in nc.sent if kind == "delta"]
    assert fulls == seqs and deltas == seqs[1:], nc.sent
    assert pub.pending == 0 and pub.metrics.snapshots_published._value.get() == len(states)
