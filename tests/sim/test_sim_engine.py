"""Simulated instance: the live engine binding, the roofline ground truth, the OpenAI API and
the snapshot/batch publication it shares with real instances."""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from bear import libbea
from bear.calibrator.fit import fit_arrays
from bear.instance.publisher import InstancePublisher
from bear.protocol.engine_ids import engine_id
from bear.protocol.subjects import Subjects
from bear.sim.engine import SimEngine
from bear.sim.profile import available_profiles, load_profile
from bear.sim.roofline import RooflineModel
from bear.sim.server import SimApi

from waiting import wait_until

SMALL = {"max_num_batched_tokens": 512, "max_num_seqs": 8, "block_size": 16, "num_gpu_blocks": 300,
         "max_model_len": 4096}


# ---------------------------------------------------------------- profiles and roofline
def test_shipped_profiles_match_public_model_sizes() -> None:
    assert {"qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100-tp2"} <= set(available_profiles())
    sizes = {n: load_profile(n).shape.total_params / 1e9 for n in ("qwen3-0.6b-h100", "qwen3-8b-h100",
                                                                   "qwen3-32b-2xh100-tp2")}
    assert sizes["qwen3-0.6b-h100"] == pytest.approx(0.6, abs=0.05)
    assert sizes["qwen3-8b-h100"] == pytest.approx(8.2, abs=0.2)
    assert sizes["qwen3-32b-2xh100-tp2"] == pytest.approx(32.8, abs=0.5)
    assert load_profile("qwen3-32b-2xh100-tp2").gpu.count == 2
    for n in available_profiles():
        cfg = load_profile(n).engine_config()
        libbea.Engine(cfg)  # a valid bear.snapshot/1 config
        assert cfg["num_gpu_blocks"] > 1000


def test_unknown_profile_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown sim profile"):
        load_profile("no-such-gpu")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="bad sim profile"):
        load_profile(str(bad))


def test_roofline_regimes() -> None:
    m = RooflineModel(load_profile("qwen3-8b-h100"))
    p = m.p
    # One decode: memory bound, ~ weights / bandwidth + overheads.
    t1 = m.mean_time([(1, 100)])
    weights_s = p.weight_bytes / (p.gpu.bandwidth_bytes_s * p.memory_efficiency)
    assert t1 == pytest.approx(weights_s + p.step_overhead_s + p.per_request_overhead_s, rel=0.05)
    # A long prefill: compute bound, doubling tokens roughly doubles the time net of overhead.
    a = m.mean_time([(4096, 0)]) - p.step_overhead_s
    b = m.mean_time([(8192, 0)]) - p.step_overhead_s
    assert 1.9 < b / a < 2.3
    # Decode context costs KV bandwidth.
    assert m.mean_time([(1, 30000)] * 32) > m.mean_time([(1, 100)] * 32) * 1.5
    # TP=2 pays all-reduces but splits the work.
    m32 = RooflineModel(load_profile("qwen3-32b-2xh100-tp2"))
    assert m32.mean_time([(1, 100)]) < RooflineModel(load_profile("qwen3-8b-h100")).mean_time([(1, 100)]) * 4


def test_roofline_is_not_eq12_and_noise_is_multiplicative() -> None:
    m = RooflineModel(load_profile("qwen3-0.6b-h100"), seed=3)
    rng = np.random.default_rng(0)
    rows, ys = [], []
    for _ in range(400):
        items = [(1, int(rng.integers(10, 8000))) for _ in range(int(rng.integers(1, 128)))]
        if rng.random() < 0.5:
            items.append((int(rng.integers(16, 8000)), int(rng.integers(0, 2000))))
        dec = [{"n": n, "context": c, "decode": n == 1} for n, c in items]
        rows.append((1.0, *libbea.batch_features(dec)))
        ys.append(m.mean_time(items))
    cal = fit_arrays(np.array(rows), np.array(ys))
    assert cal.mape > 0.005  # the roofline kink is not representable by eq. 12
    draws = np.array([m.sample([(1, 500)] * 16) for _ in range(2000)])
    mean = m.mean_time([(1, 500)] * 16)
    assert abs(np.median(draws) / mean - 1) < 0.02
    assert 0.01 < np.std(np.log(draws)) < 0.1


# ---------------------------------------------------------------- engine binding
def test_engine_rejects_bad_input() -> None:
    e = libbea.Engine(SMALL)
    e.add("a", 10, 5, 5)
    with pytest.raises(ValueError, match="duplicate"):
        e.add("a", 10, 5, 5)
    with pytest.raises(ValueError, match="max_model_len"):
        e.add("b", 4096, 5, 5)
    with pytest.raises(ValueError, match="async"):
        libbea.Engine({**SMALL, "async_scheduling": True})
    with pytest.raises(ValueError, match="block_size"):
        libbea.Engine({k: v for k, v in SMALL.items() if k != "block_size"})
    assert e.abort("a") and not e.abort("a") and not e.abort("zz")


def test_engine_runs_requests_to_their_true_length() -> None:
    e = libbea.Engine(SMALL)
    e.add("long", 1000, 50, 3)  # prompt chunked over two steps (budget 512)
    e.add("short", 20, 4, 10)  # stops at max_tokens
    tokens: dict[str, int] = {}
    finished = set()
    steps = 0
    while e.has_work:
        batch = e.step()
        assert batch
        for rid, n, ctx, decode in batch:
            assert decode == (n == 1 and ctx >= (1000 if rid == "long" else 20))
        for rid, out, fin in e.finish_step():
            assert out == tokens.get(rid, 0) + 1
            tokens[rid] = out
            if fin:
                finished.add(rid)
        steps += 1
        assert steps < 100
    assert tokens == {"long": 3, "short": 4} and finished == {"long", "short"}
    assert e.free_blocks == SMALL["num_gpu_blocks"] and e.live == 0


def _drive(e: libbea.Engine, steps: int) -> None:
    for _ in range(steps):
        if e.step():
            e.finish_step()


def test_engine_schedule_matches_the_bea_replay() -> None:
    """The sim engine and the BEA replay run one scheduler: from an engine snapshot, a replay with
    the true lengths reproduces the engine's batches until the new request's first token."""
    cfg = {**SMALL, "num_gpu_blocks": 120, "max_num_seqs": 6}
    rng = np.random.default_rng(5)
    for trial in range(5):
        e = libbea.Engine(cfg)
        lengths = {}
        for k in range(12):
            rid = f"t{trial}-{k}"
            out = int(rng.integers(2, 60))
            e.add(rid, int(rng.integers(10, 400)), 64, out)
            lengths[rid] = out
        _drive(e, int(rng.integers(1, 20)))
        snap = libbea.Snapshot.from_dict(e.snapshot("i", "m", 0.0))
        query = {"id": "new", "prompt_tokens": int(rng.integers(50, 900)), "max_tokens": 8}
        est = libbea.estimate(snap, query, beta=[1e-3, 0, 0, 0], lengths=lengths, trace=True)
        e.add("new", query["prompt_tokens"], 8, 8)
        seen = []
        while True:
            batch = e.step()
            seen.append({rid: n for rid, n, _, _ in batch})
            outs = e.finish_step()
            if any(rid == "new" for rid, _, _ in outs):
                break
        assert seen == est["batches"], f"trial {trial}"


def test_n_sequences_replay_as_vllm_queues_its_children() -> None:
    """A query with n > 1 runs as n engine requests named ``<k>_<id>`` queued together, the later
    ones hitting the first one's blocks (prefix caching): the replay with ``sequences`` = n
    reproduces the engine's batches until the first child's first token."""
    cfg = {**SMALL, "enable_prefix_caching": True}
    rng = np.random.default_rng(7)
    differs = 0
    for trial in range(12):
        e = libbea.Engine(cfg)
        lengths = {}
        for k in range(10):
            rid, out, p = f"t{trial}-{k}", int(rng.integers(2, 60)), int(rng.integers(10, 400))
            e.add(rid, p, 64, out, block_hashes=[int(x) for x in rng.integers(1, 2**62, size=p // 16)])
            lengths[rid] = out
        _drive(e, int(rng.integers(1, 20)))
        snap = libbea.Snapshot.from_dict(e.snapshot("i", "m", 0.0))
        n, p = int(rng.integers(2, 5)), int(rng.integers(50, 900))
        query = {"id": "new", "prompt_tokens": p, "max_tokens": 8, "sequences": n}
        est = libbea.estimate(snap, query, beta=[1e-3, 0, 0, 0], lengths=lengths, trace=True)
        one = libbea.estimate(snap, {**query, "sequences": 1}, beta=[1e-3, 0, 0, 0], lengths=lengths, trace=True)
        differs += est["batches"] != one["batches"]
        hashes = [int(x) for x in rng.integers(1, 2**62, size=p // 16)]
        for k in range(n):
            e.add(f"{k}_new", p, 8, 8, block_hashes=hashes)
        seen = []
        while True:
            seen.append({rid: m for rid, m, _, _ in e.step()})
            if any(rid == "0_new" for rid, _, _ in e.finish_step()):
                break
        assert seen == est["batches"], f"trial {trial}"
    assert differs > 0  # the siblings changed some replays


def test_engine_memory_stays_bounded() -> None:
    e = libbea.Engine({**SMALL, "max_num_seqs": 64, "max_num_batched_tokens": 4096})
    for k in range(6000):
        e.add(f"r{k}", 8, 1, 1)
        if k % 100 == 99:
            _drive(e, 3)
    _drive(e, 200)
    assert e.live == 0 and not e.has_work
    e.add("after", 8, 2, 2)
    _drive(e, 3)
    assert e.live == 0
    assert e.table_size < 4200  # finished requests were dropped from the table


# ---------------------------------------------------------------- OpenAI API
@pytest.fixture
async def api():
    profile = load_profile("qwen3-0.6b-h100")
    sim = SimEngine(profile, "sim-t", seed=1)
    task = asyncio.create_task(sim.run())
    client = TestClient(TestServer(SimApi(sim).app()))
    await client.start_server()
    yield client, sim
    await client.close()
    sim.stop()
    await task


def _events(body: str) -> list:
    return [ev[len("data: "):] for ev in body.split("\n\n") if ev.startswith("data: ")]


async def test_completions_stream_and_usage(api) -> None:
    client, sim = api
    r = await client.post("/v1/completions", json={"prompt": list(range(300)), "max_tokens": 12,
                                                   "stream": True, "stream_options": {"include_usage": True}},
                          headers={"X-Request-Id": "req-1"})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    ev = _events(await r.text())
    assert ev[-1] == "[DONE]"
    chunks = [json.loads(x) for x in ev[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert len(texts) == 12 and all(c["id"] == "req-1" for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"  # the default model never emits EOS
    assert chunks[-1]["usage"] == {"prompt_tokens": 300, "completion_tokens": 12, "total_tokens": 312}
    ttft = sim.ttft(engine_id("req-1", chat=False))  # the engine names it as vLLM does
    assert ttft is not None and 0 < ttft < 1.0


async def test_chat_completions_stream_and_plain(api) -> None:
    client, _ = api
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 400}],
                                                        "max_tokens": 5, "stream": True})
    chunks = [json.loads(x) for x in _events(await r.text())[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 3})
    body = await r.json()
    # ≈ bytes / 4 per message plus the chat template's tokens (3 + 4 per message)
    assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens"] == 3 + 4 + 1
    assert len(body["choices"][0]["message"]["content"].split()) == 3


def test_output_lengths_are_the_engines_own_and_repeat_per_seed() -> None:
    from bear.sim.lengths import OutputLengths

    assert OutputLengths.parse("max").tokens("a", 77) == 77
    ln = OutputLengths.parse("lognormal:200:0.8", seed=3)
    draws = [ln.tokens(f"r{k}", 4096) for k in range(2000)]
    assert draws == [OutputLengths.parse("lognormal:200:0.8", seed=3).tokens(f"r{k}", 4096) for k in range(2000)]
    assert draws != [OutputLengths.parse("lognormal:200:0.8", seed=4).tokens(f"r{k}", 4096) for k in range(2000)]
    assert 170 < float(np.median(draws)) < 230 and min(draws) >= 1
    assert max(ln.tokens(f"r{k}", 50) for k in range(200)) == 50  # capped by max_tokens
    for bad in ("", "lognormal:0:1", "lognormal:100", "lognormal:100:-1", "uniform:1:2", "lognormal:x:1"):
        with pytest.raises(ValueError):
            OutputLengths.parse(bad)


async def test_api_errors(api) -> None:
    client, sim = api
    cases = [
        (b"{bad", 400),
        (json.dumps({"prompt": "x", "model": "other/model"}).encode(), 404),
        (json.dumps({"prompt": list(range(50000))}).encode(), 400),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400),
        (json.dumps({"prompt": "x", "max_tokens": 10_000_000}).encode(), 400),  # beyond the context: refused, as vLLM
        (json.dumps({"prompt": 12}).encode(), 400),
    ]
    for data, status in cases:
        r = await client.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
        assert r.status == status
        assert (await r.json())["object"] == "error"
    r = await client.get("/v1/models")
    assert (await r.json())["data"][0]["id"] == sim.model_name


async def test_client_disconnect_aborts_the_request(api) -> None:
    client, sim = api
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 40000, "stream": True},
                          headers={"X-Request-Id": "gone"})
    await r.content.readline()
    r.close()
    await wait_until(lambda: sim.stats.aborted, what="the abort")
    assert sim.stats.aborted == 1 and sim.engine.live == 0


# ---------------------------------------------------------------- publication
async def test_sim_publishes_snapshots_and_batches(nats_server) -> None:
    import nats

    nc = await nats.connect(nats_server.url)
    snaps: list[bytes] = []
    deltas: list[bytes] = []
    groups: list[list] = []
    subjects = Subjects()

    async def on_snap(m) -> None:
        snaps.append(m.data)

    async def on_delta(m) -> None:
        deltas.append(m.data)

    async def on_batches(m) -> None:
        groups.append(msgpack.unpackb(m.data))

    await nc.subscribe(subjects.snapshot("pub-a"), cb=on_snap)
    await nc.subscribe(subjects.delta("pub-a"), cb=on_delta)
    await nc.subscribe(subjects.batches("pub-a"), cb=on_batches)
    pub = InstancePublisher(nc, "pub-a", subjects, idle_snapshot_s=0.2, batch_flush_s=0.05)
    sim = SimEngine(load_profile("qwen3-0.6b-h100"), "pub-a", pub, seed=2)
    tasks = [asyncio.create_task(pub.run()), asyncio.create_task(sim.run())]
    reqs = [sim.submit(f"p{k}", 200 + 50 * k, 20, 5 + k) for k in range(4)]
    for r in reqs:
        while not r.finished:
            await r.changed.wait()
            r.changed.clear()
    n_busy = len(deltas)
    t_idle = max(r.finished_at for r in reqs)  # the engine's clock when it went idle
    # idle: heartbeats keep the snapshot fresh — wait for one to arrive
    await wait_until(lambda: len(snaps) >= 2 and msgpack.unpackb(snaps[-1]).get("idle"), what="an idle re-send")
    sim.stop()
    await pub.close()
    for t in tasks:
        t.cancel()
    await nc.flush()
    # everything published has arrived: a batch record per step, a delta per published state
    await wait_until(lambda: sum(map(len, groups)) == sim.stats.steps, what="the batch records of every step")
    await wait_until(lambda: len(deltas) == pub.metrics.deltas_published._value.get(), what="every delta")
    await nc.close()
    # every step a delta; full snapshots: the initial state, then only the idle re-sends
    parsed = [libbea.Snapshot.from_msgpack(b) for b in snaps]
    assert parsed[0].n_running == 0 and n_busy >= 3 and len(deltas) >= n_busy
    mirror, busy = parsed[0], 0
    for b in deltas:
        mirror.apply_delta(libbea.Delta.from_msgpack(b))
        busy += mirror.n_running > 0
    assert busy > 0 and libbea.snapshot_difference(mirror, parsed[-1], compare_time=False) is None
    assert len(snaps) >= 2 and pub.metrics.idle_resends._value.get() >= 1
    last = msgpack.unpackb(snaps[-1])
    assert last["v"] == "bear.snapshot/1" and last["instance"] == "pub-a" and t_idle <= last["time"] <= time.time()
    records = [r for g in groups for r in g]
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    assert all(r["v"] == "bear.batch/1" and r["instance"] == "pub-a" for r in records)
    assert records[-1]["duration_s"] is None  # the engine went idle after it
    assert all(d > 0 for d in (r["duration_s"] for r in records[:-1]) if d is not None)
    assert sum(it["n"] for r in records for it in r["items"] if not it["decode"]) == sum(200 + 50 * k for k in range(4))

