"""Fuzz the C++ core under AddressSanitizer + UndefinedBehaviorSanitizer.

Builds the standalone driver (libbea/fuzz/check_main.cpp) with -fsanitize=address,undefined and
feeds it valid, truncated, byte-flipped and random msgpack inputs; any memory error or UB aborts
the driver with a non-zero exit.
"""

from __future__ import annotations

import copy
import random
import subprocess
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from bea_helpers import decoding, req, snapshot


def delta_chains() -> list[list[dict]]:
    """[snapshot, delta, ...] inputs: the driver applies the deltas before the replay (each chain
    checked here to apply in full, so that the mutations start from real chains)."""
    from bear import libbea
    from bear.instance.delta import encode_delta
    from bear.protocol.codec import pack

    eng = libbea.Engine({"max_num_batched_tokens": 256, "max_num_seqs": 8, "block_size": 16, "num_gpu_blocks": 60,
                         "max_model_len": 2048})
    rng = random.Random(5)
    states = [eng.snapshot("i", "m", 0.0)]
    for step in range(120):
        if rng.random() < 0.3:
            eng.add(f"r{step}", rng.randint(5, 300), rng.randint(1, 40), rng.randint(1, 40))
        if eng.has_work and eng.step():
            eng.finish_step()
        if eng.seq != states[-1]["seq"]:  # one published state per engine step
            states.append(eng.snapshot("i", "m", float(step)))
    chains = []
    for start in range(0, len(states) - 10, 10):
        ds = [encode_delta(a, b) for a, b in zip(states[start:start + 10], states[start + 1:start + 11], strict=True)]
        assert all(d is not None for d in ds)
        mirror = libbea.Snapshot.from_dict(states[start])
        for d in ds:
            mirror.apply_delta(libbea.Delta.from_msgpack(pack(d)))
        assert libbea.snapshot_difference(mirror, libbea.Snapshot.from_dict(states[start + 10])) is None
        chains.append([states[start], *ds])
    assert len(chains) >= 5
    return chains


def pool_chains() -> list[list[dict]]:
    """[snapshot with the table in stable form, delta with its change, ...] chains from random
    engine runs (issue 28), and structured mutations of their tables and changes."""
    from pool_sim import PoolSim

    from bear.instance.delta import encode_delta
    from bear.prefix.tracked_pool import PoolTable, TrackedPool

    def state(sim: PoolSim, step: dict) -> dict:
        def r(rid: str, bl: list[int] | None) -> dict:
            p, held = 16 * len(sim.prompts[rid]) + 8, len(bl or ())
            return {"id": rid, "prompt_tokens": p, "computed_tokens": min(p, 16 * held), "output_tokens": 0,
                    "max_tokens": 64, "blocks": held, "exclusive_blocks": held,
                    "preemptions": sim.preemptions.get(rid, 0)}

        return {"seq": step["seq"], "time": float(step["seq"]), "free_blocks": step["free_blocks"],
                "config": {"max_num_batched_tokens": 256, "max_num_seqs": 16, "block_size": 16,
                           "num_gpu_blocks": sim.n, "max_model_len": 4096, "enable_prefix_caching": True},
                "running": [r(x[0], step["block_ids"][x[0]]) for x in step["running"]],
                "waiting": [r(x[0], None) for x in step["waiting"]]}

    rng = random.Random(17)
    chains = []
    for seed in range(6):
        sim = PoolSim(40, seed)
        pool = TrackedPool(sim.n)
        table = PoolTable(pool)
        chain: list[dict] = []
        prev = None
        for _ in range(60):
            step = sim.step()
            pool.step(step)
            cur = state(sim, step)
            change = table.update(cur)
            if change is None or prev is None or len(chain) >= 12:
                if chain:
                    chains.append(chain)
                full = state(sim, step)
                table.full(full)
                chain = [full]
            else:
                d = encode_delta(prev, cur)
                assert d is not None
                d["pool"] = change
                chain.append(d)
            prev = cur
        chains.append(chain)
    out = list(chains)
    for chain in chains:
        for _ in range(4):
            c = copy.deepcopy(chain)
            k = rng.randrange(len(c))
            target = c[k]
            if k == 0:
                rows = target["pool_table"]
                if rows and rng.random() < 0.5:
                    rows[rng.randrange(len(rows))] = rng.choice([-2, -1, 0, 39, 40, 1 << 62])
                elif target["running"]:
                    target["running"][0]["tracked_ids"] = [rng.randint(-1, 41) for _ in range(rng.randint(0, 5))]
            else:
                pc = target["pool"]
                key = rng.choice(["put", "drop", "tracked", "keys"])
                lst = pc.setdefault(key, [])
                if lst and rng.random() < 0.6:
                    lst[rng.randrange(len(lst))] = rng.choice([-2, -1, 0, 1, 39, 40, 1 << 62])
                else:
                    lst.extend(rng.randint(-1, 41) for _ in range(rng.randint(1, 6)))
            out.append(c)
    assert len(out) > 20
    return out


def tracked_snapshots() -> list[dict]:
    """Sim-engine snapshots with tracked-block tables under KV pressure (each with its query), and
    structured mutations of their tables: the ledger's inputs, valid and nearly valid."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "sim"))
    from test_tracked_ledger_oracle import run_case

    rng = random.Random(11)
    out = []
    for seed in range(40):
        case = run_case(seed)
        if not case.snapshot.get("tracked_blocks"):
            continue
        out.append(case.snapshot)
        for _ in range(5):
            s = copy.deepcopy(case.snapshot)
            t = s["tracked_blocks"]
            pick = rng.random()
            if pick < 0.3 and t:
                t[rng.randrange(len(t))] = rng.randint(-3, s["free_blocks"] + 2)
            elif pick < 0.45:
                s["tracked_keys"] = [rng.randint(-2, 5) for _ in range(len(t) + rng.randint(-1, 1))]
            elif pick < 0.6:
                r = rng.choice(s["running"] + s["waiting"] or [{}])
                key = rng.choice(["tracked", "hit_blocks", "block_keys"])
                r[key] = [rng.randint(-1, len(t) + 1) for _ in range(rng.randint(0, 6))]
            else:
                s["query"] = {"prompt_tokens": rng.randint(1, 900), "max_tokens": 8,
                              "hit_blocks": rng.sample(range(len(t) + 2), min(len(t) + 2, rng.randint(0, 4))),
                              "block_keys": [rng.randint(0, 40) for _ in range(rng.randint(0, 8))],
                              "sequences": rng.choice([1, 2, 5]), "skip_reading_prefix_cache": rng.random() < 0.3}
            out.append(s)
    assert len(out) > 60
    return out


@pytest.mark.slow
def test_sanitized_fuzz(tmp_path: Path, sanitized_tool: Callable[[str], Path]) -> None:
    bea_check = sanitized_tool("bea_check")
    rng = random.Random(3)
    seeds = [
        snapshot([decoding("A", 100, 3), req("X", 500, c=100, blocks=7)], [req("W", 70)]),
        snapshot([decoding("A", 16, 1, blocks=1), decoding("B", 16, 1, blocks=1)], free=1),
        snapshot([decoding("A", 16, 1, blocks=1, placeholders=1)], free=2, async_scheduling=True,
                 inflight={"started": 100.0, "items": [{"id": "A", "n": 1, "context": 15}]}),
        snapshot([], [req("W", 5000)], free=4, num_gpu_blocks=5, policy="priority"),
        {**snapshot([decoding("A", 100, 3)], enable_prefix_caching=True),  # n children, prompt logprobs
         "query": {"prompt_tokens": 300, "max_tokens": 4, "sequences": 7, "prefix_hit_tokens": 64,
                   "skip_reading_prefix_cache": False}},
        {**snapshot([], [req("W", 70)], free=3, num_gpu_blocks=5, enable_prefix_caching=True),
         "query": {"prompt_tokens": 40, "sequences": 1024, "skip_reading_prefix_cache": True}},
    ]
    seeds += delta_chains()
    seeds += tracked_snapshots()
    seeds += pool_chains()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    n = 0
    for s in seeds:
        base = msgpack.packb(s)
        variants = [base] + [base[: rng.randrange(len(base))] for _ in range(50)]
        for _ in range(300):
            b = bytearray(base)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.getrandbits(8)
            variants.append(bytes(b))
        variants += [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 128))) for _ in range(100)]
        for v in variants:
            (corpus / f"{n:05d}").write_bytes(v)
            n += 1
    files = sorted(str(p) for p in corpus.iterdir())
    for k in range(0, len(files), 400):
        out = subprocess.run([str(bea_check), *files[k : k + 400]], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-4000:]
        assert "checked" in out.stdout
