"""Drive the BEAR plugin's scheduler (a real vLLM ``Scheduler`` subclass) without a model: a fake
model runner samples one token for every request whose scheduled chunk reaches the end of its
known sequence, exactly as vLLM's runner does in sync mode. Runs with the vLLM venv's Python
(``BEAR_VLLM_PYTHON``); used by ``test_vllm_delta.py`` and as a micro-benchmark:

    python offline_scheduler.py bench  MODEL_DIR [--residents 256] [--steps 400] [--mode delta|full] [--churn]
    python offline_scheduler.py verify MODEL_DIR [--seed 1] [--steps 3000] [--prefix]

``bench`` keeps ``--residents`` requests decoding and prints the plugin's own overhead per step;
``verify`` runs a random workload (bursty arrivals, shared prefixes, chunked prefill, long-prefill
threshold, KV pressure with preemptions, aborts) with ``BEAR_SNAPSHOT_VERIFY=1`` and checks, with
the snapshotter's decoder, that the state mirrored from the deltas equals the full state after
every step. Both print one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
PLUGIN_DIR = HERE.parents[2] / "services" / "snapshotter"
sys.path.insert(0, str(PLUGIN_DIR))


def make_scheduler(model: str, *, blocks: int, max_len: int, seqs: int, budget: int, lpt: int = 0,
                   prefix: bool = True, chunked: bool = True, policy: str = "fcfs") -> tuple[Any, Any]:  # fmt: skip
    import bear_vllm_plugin
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    mc = ModelConfig(model=model, max_model_len=max_len, skip_tokenizer_init=True)
    sc = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                         is_encoder_decoder=False, enable_chunked_prefill=chunked,
                         long_prefill_token_threshold=lpt, policy=policy)  # fmt: skip
    cc = CacheConfig(block_size=128, enable_prefix_caching=prefix)
    cc.num_gpu_blocks = blocks
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    spec = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=32, dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])  # fmt: skip
    sched = bear_vllm_plugin.make_scheduler(
        vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
        block_size=128, hash_block_size=128, include_finished_set=False, log_stats=False,
    )  # fmt: skip
    hasher = None
    if prefix:
        fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
        init_none_hash(fn)
        hasher = get_request_block_hasher(128, fn)
    return sched, hasher


def new_request(rid: str, prompt: list[int], max_tokens: int, hasher: Any, priority: int = 0,
                eos: bool = False) -> Any:  # fmt: skip
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=not eos, temperature=0.0)
    if eos:
        sp.update_from_generation_config({}, EOS)
    return Request(rid, prompt, sp, None, arrival_time=time.time(), block_hasher=hasher, priority=priority)


def run_model(sched: Any, out: Any, eos: float = 0.0, rng: random.Random | None = None) -> Any:
    """What the sync model runner returns: one token for a request whose scheduled chunk reaches
    the end of its known tokens (computed already advanced by schedule()), none otherwise; with
    probability ``eos`` that token is the EOS token (requests made with ``eos=True`` stop on it).
    Call right after schedule(): aborts that happen while the batch runs do not change it."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = sched.requests.get(rid)
        tok = EOS if eos and rng is not None and rng.random() < eos else 7
        sampled.append([tok] if r is not None and r.num_computed_tokens >= r.num_tokens else [])
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)  # fmt: skip


EOS = 0


def step(sched: Any) -> None:
    out = sched.schedule()
    sched.update_from_output(out, run_model(sched, out))


def read_all(shm: str) -> list[Any]:
    from shm import ShmReader

    r = ShmReader(shm)
    recs = r.poll().records
    r.close()
    return recs


def bench(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["BEAR_SNAPSHOT_SHM"] = shm = f"bear-bench-{uuid.uuid4().hex[:8]}"
    os.environ["BEAR_SNAPSHOT_SLOTS"] = str(args.steps + 16)
    if args.mode == "full":
        os.environ["BEAR_SNAPSHOT_DELTA"] = "0"
    sched, hasher = make_scheduler(args.model, blocks=4000, max_len=4096, seqs=args.residents, budget=8192)
    rng = random.Random(0)

    def add() -> None:  # ids like the API server's; churn: ~2.5 requests finish per step
        n_out = rng.randint(50, 150) if args.churn else args.steps + 10
        sched.add_request(new_request(f"cmpl-{uuid.uuid4().hex}-0", [rng.randrange(256) for _ in range(16)],
                                      n_out, hasher))  # fmt: skip

    for _ in range(args.residents):
        add()
    for _ in range(args.steps):
        step(sched)
        for _ in range(args.residents - len(sched.requests)):
            add()
    recs = read_all(shm)
    os.unlink(f"/dev/shm/{shm}")
    import step_decoder

    dec = step_decoder.StepDecoder()
    steps = [dec.decode(r) for r in recs]
    # steady state only: every request resident and decoding (periodic full records included)
    rows = [s for s in steps[3:] if s is not None and len(s["sched"]) >= 0.95 * args.residents]
    wall = sorted(s["overhead_ns"] / 1e3 for s in rows)
    cpu = sorted(s["overhead_cpu_ns"] / 1e3 for s in rows)
    kinds: dict[str, int] = {}
    for s in rows:
        kinds[s["record"]] = kinds.get(s["record"], 0) + 1
    q = lambda xs, p: xs[min(len(xs) - 1, int(len(xs) * p))]  # noqa: E731
    return {"mode": args.mode, "churn": args.churn, "residents": args.residents, "steps": len(rows), "records": kinds,
            "wall_us_median": q(wall, 0.5), "wall_us_p90": q(wall, 0.9), "wall_us_mean": sum(wall) / len(wall),
            "cpu_us_min": cpu[0], "cpu_us_median": q(cpu, 0.5), "cpu_us_p90": q(cpu, 0.9), "cpu_us_p99": q(cpu, 0.99), "wall_us_p99": q(wall, 0.99),
            "cpu_us_mean": sum(cpu) / len(cpu),
            "loadavg": os.getloadavg()[0]}  # fmt: skip

VERIFY_CONFIGS: dict[str, dict[str, Any]] = {
    # chunked prefill + long-prefill threshold + prefix caching with shared prefixes, queueing
    "prefix-lpt": {"blocks": 400, "max_len": 4096, "seqs": 24, "budget": 512, "lpt": 200, "prefix": True},
    # KV pressure: preemptions with prefix caching on (own blocks often still cached on resume)
    "kv-pressure-prefix": {"blocks": 48, "max_len": 2048, "seqs": 16, "budget": 512, "prefix": True},
    # KV pressure without prefix caching (the real-vLLM kv-pressure configuration)
    "kv-pressure": {"blocks": 40, "max_len": 2048, "seqs": 16, "budget": 512, "prefix": False},
    # no chunked prefill: head-of-line admission
    "no-chunking": {"blocks": 300, "max_len": 2048, "seqs": 32, "budget": 2048, "prefix": True, "chunked": False},
}


def verify(args: argparse.Namespace) -> dict[str, Any]:
    """A random workload on the offline scheduler with BEAR_SNAPSHOT_VERIFY=1 (every record carries
    the delta and the full state); the snapshotter's decoder applies each delta to its mirror and
    compares. Also aborts (between steps and while a batch runs), EOS stops and prefix-cache
    resets with preemption of every running request (between steps)."""
    sys.path.insert(0, str(PLUGIN_DIR))
    import step_decoder
    from vllm.v1.request import RequestStatus

    os.environ["BEAR_SNAPSHOT_SHM"] = shm = f"bear-verify-{uuid.uuid4().hex[:8]}"
    os.environ["BEAR_SNAPSHOT_SLOTS"] = "64"
    os.environ["BEAR_SNAPSHOT_SLOT_BYTES"] = str(1 << 20)
    if args.mode == "verify":
        os.environ["BEAR_SNAPSHOT_VERIFY"] = "1"
    else:
        os.environ["BEAR_SNAPSHOT_FULL_EVERY"] = str(args.full_every)
    cfg = VERIFY_CONFIGS[args.config]
    sched, hasher = make_scheduler(args.model, **cfg)
    from shm import ShmReader

    reader = ShmReader(shm)
    dec = step_decoder.StepDecoder()
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(256) for _ in range(rng.choice([128, 256, 384]))] for _ in range(4)]
    kinds: dict[str, int] = {}
    problems: list[str] = []
    n_req = preempted = aborted = resets = eos_stops = prefix_hits = chaos = 0
    max_res = 0

    dumped: list[Any] = []

    def drain() -> None:
        res = reader.poll()
        assert res.skipped == 0, "ring overwrote records: read more often"
        if args.dump:
            dumped.extend(res.records)
        for raw in res.records:
            step = dec.decode(raw)
            if dec.last_problem:
                problems.append(f"seq {raw[1]}: {dec.last_problem}")
            if step is None:
                problems.append(f"seq {raw[1]}: undecodable")
                continue
            kinds[step["record"]] = kinds.get(step["record"], 0) + 1

    for i in range(args.steps):
        burst = rng.random() < 0.15
        for _ in range(rng.choice([1, 2, 5]) if burst else int(rng.random() < 0.35)):
            n_req += 1
            pre = rng.choice(prefixes) if cfg.get("prefix") and rng.random() < 0.6 else []
            n = rng.randint(1, 700)
            prompt = pre + [rng.randrange(256) for _ in range(n)]
            prompt = prompt[: cfg["max_len"] - 200]
            req = new_request(f"r{n_req}-{uuid.uuid4().hex[:6]}", prompt, rng.randint(1, 120), hasher,
                              eos=rng.random() < 0.3)  # fmt: skip
            sched.add_request(req)
        if sched.requests and rng.random() < 0.03:  # client gone between steps
            victim = rng.choice(list(sched.requests))
            aborted += len(sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED))
        if sched.running and rng.random() < 0.004:
            resets += 1
            sched.reset_prefix_cache(reset_running_requests=True)
        if args.chaos and rng.random() < 0.01:  # a change of order no mirror rule describes
            chaos += 1
            if len(sched.waiting) > 1 and rng.random() < 0.5:
                sched.waiting.rotate(1)
            elif len(sched.running) > 1:
                sched.running[0], sched.running[-1] = sched.running[-1], sched.running[0]
        if i == args.resync_at:  # what the heartbeat thread does when a reader asks for a full record
            sched._bear_resync = True
        if not sched.has_requests():
            continue
        out = sched.schedule()
        preempted += len(out.preempted_req_ids or ())
        prefix_hits += sum(1 for nr in out.scheduled_new_reqs if nr.num_computed_tokens > 0)
        mro = run_model(sched, out, eos=0.02, rng=rng)
        if out.num_scheduled_tokens and rng.random() < 0.03:  # aborted while the batch runs
            victim = rng.choice(list(out.num_scheduled_tokens))
            aborted += len(sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED))
        before = len(sched.requests)
        sched.update_from_output(out, mro)
        eos_stops += before - len(sched.requests)
        max_res = max(max_res, len(sched.running) + len(sched.waiting))
        if i % 16 == 0:
            drain()
    drain()
    meta = reader.meta()
    reader.close()
    os.unlink(f"/dev/shm/{shm}")
    if args.dump:  # the raw records, for a check outside the vLLM venv (libbea)
        import gzip
        import marshal

        with gzip.open(args.dump, "wb") as f:
            marshal.dump((meta, dumped), f)
    return {"config": args.config, "mode": args.mode, "seed": args.seed, "steps": reader.next_index,
            "requests": n_req, "max_resident": max_res, "preemptions": preempted, "aborts": aborted,
            "stops": eos_stops, "prefix_hit_admissions": prefix_hits, "prefix_resets": resets, "chaos": chaos,
            "records": kinds, "decoder": dec.stats, "problems": problems[:20]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["bench", "verify"])
    p.add_argument("model")
    p.add_argument("--residents", type=int, default=256)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--mode", default="delta")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--config", default="prefix-lpt", choices=list(VERIFY_CONFIGS))
    p.add_argument("--full-every", type=int, default=256)
    p.add_argument("--churn", action="store_true", help="bench: requests finish and new ones arrive")
    p.add_argument("--dump", default=None, help="verify: write the raw records (gzip'd marshal) here")
    p.add_argument("--chaos", action="store_true", help="verify: reorder vLLM's queues behind the plugin's back")
    p.add_argument("--resync-at", type=int, default=-1, help="verify: a reader asks for a full record at this step")
    args = p.parse_args()
    res = bench(args) if args.what == "bench" else verify(args)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
