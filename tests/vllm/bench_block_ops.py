"""Plugin time per step with BEAR_SNAPSHOT_BLOCK_OPS off vs on, on one load (the KV-pressure chat
sessions of tests/vllm/test_vllm_prefix.py), runs alternating off / on / off / on; prints one
JSON line per run and writes OUTDIR/result.json:

    BEAR_VLLM_PYTHON=~/.cache/bear/vllm-venv/bin/python .venv/bin/python tests/vllm/bench_block_ops.py OUTDIR
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import ChatSessions, VllmServer, make_tiny_model, run_chat_sessions, vllm_python

from bear.replay.recorded_run import generations
from bear.runtime.nats_server import LocalNatsServer
from bear.snapshotter.service import Snapshotter, SnapshotterConfig
from bear.tokenizer.bundle import from_model_dir
from bear.tokenizer.cache import load

from waiting import wait_until

ARGS = ["--max-model-len", "4096", "--max-num-batched-tokens", "512", "--max-num-seqs", "16",
        "--num-gpu-blocks-override", "48"]


async def one_run(out: Path, py: str, model: Path, ops: bool, k: int) -> dict[str, Any]:
    env = {"BEAR_SNAPSHOT_SLOTS": "1024", **({"BEAR_SNAPSHOT_BLOCK_OPS": "1"} if ops else {})}
    srv = VllmServer(py, model, ARGS, log_path=out / f"vllm-{k}.log", env=env)
    log = out / f"steps-{k}-{'on' if ops else 'off'}.jsonl.gz"
    tok = load(from_model_dir(model))
    with LocalNatsServer() as ns:
        await asyncio.to_thread(srv.start)
        try:
            svc = Snapshotter(SnapshotterConfig(instance="bench", shm=srv.shm, nats_url=ns.url, model="tiny",
                                                base_url=srv.base_url, record_to=str(log)))
            task = asyncio.create_task(svc.run())
            await wait_until(lambda: svc.publisher.nc is not None and svc._reader is not None, timeout=120,
                             what="the snapshotter attached")
            await run_chat_sessions(srv.base_url, ChatSessions(n_sessions=32, session_rate=3.0, seed=22),
                                    lambda msgs: tok.encode(None, msgs))
            await wait_until(lambda: svc._reader.next_index >= svc._reader.count, timeout=120,
                             what="the snapshotter caught up with the ring")
            svc.stop()
            await asyncio.wait_for(task, 15)
        finally:
            srv.stop()
    ((_, steps),) = generations(log)
    wall = [s["overhead_ns"] / 1e3 for s in steps if s["seq"] > 0]
    cpu = [s["overhead_cpu_ns"] / 1e3 for s in steps if s["seq"] > 0]
    return {"block_ops": ops, "steps": len(wall), "wall_us_p50": float(np.percentile(wall, 50)),
            "wall_us_p99": float(np.percentile(wall, 99)), "cpu_us_p50": float(np.percentile(cpu, 50)),
            "cpu_us_p99": float(np.percentile(cpu, 99)), "cpu_us_mean": float(np.mean(cpu))}


async def main(out: Path, py: str, model: Path) -> None:
    res = []
    for k, ops in enumerate([False, True, False, True]):
        r = await one_run(out, py, model, ops, k)
        print(json.dumps(r), flush=True)
        res.append(r)
    (out / "result.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    OUT = Path(sys.argv[1])
    OUT.mkdir(parents=True, exist_ok=True)
    PY = vllm_python()
    if not (OUT / "tiny").exists():
        make_tiny_model(PY, OUT / "tiny")
    asyncio.run(main(OUT, PY, OUT / "tiny"))
