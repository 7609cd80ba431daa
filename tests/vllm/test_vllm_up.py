"""``bear up --backend vllm`` as a user runs it: two tiny-model CPU vLLM instances (plugin +
snapshotter each), predictor, estimator, calibrator and router as child processes on a given NATS;
queries through the client are answered by real vLLM with BEA estimates; Ctrl-C stops every child,
vLLM included."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nats
import pytest

from bear.client.submit import submit
from bear.runtime.nats_server import LocalNatsServer
from bear.vllm_instance.launch import healthy

# `bear up` with its default ports (the gateway's 8000): one such module at a time (docs/testing.md)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("bear_up_ports")]


def _read_until(proc: subprocess.Popen[str], lines: list[str], marker: str, timeout_s: float) -> None:
    """Collect the process's stdout lines until ``marker`` appears (or fail after timeout_s)."""
    done = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                done.set()
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    end = time.monotonic() + timeout_s
    while not done.wait(1.0):
        assert time.monotonic() < end, f"`bear up` not up after {timeout_s} s:\n{''.join(lines)[-3000:]}"
    assert any(marker in ln for ln in lines), f"`bear up` exited ({proc.poll()}):\n{''.join(lines)[-3000:]}"


def _stack_rings() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("bear-vllm-[0-9]*-*")}


async def _queries(url: str, n: int) -> list[list[dict]]:
    nc = await nats.connect(url)
    try:
        async def one(i: int) -> list[dict]:
            return [m async for m in submit(nc, f"up {i}: " + "word " * (10 + 7 * i), ttft_target_s=5.0,
                                            max_tokens=8, query_id=f"up-{i}", idle_timeout_s=60.0)]

        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await nc.close()


def test_bear_up_backend_vllm(vllm_py: str, tmp_path: Path) -> None:
    work = tmp_path / "up"
    rings_before = _stack_rings()
    with LocalNatsServer() as nats_srv:
        env = {**os.environ, "BEAR_VLLM_PYTHON": vllm_py, "COLUMNS": "250", "TERM": "dumb", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "bear", "up", "--backend", "vllm", "--nats", nats_srv.url, "--workdir", str(work),
             "--metrics-port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        lines: list[str] = []
        try:
            _read_until(proc, lines, "Ctrl-C stops everything", 1200.0)
            ports = {m[1]: int(m[2]) for m in re.finditer(r"instance (vllm-\d+)\s+http://127\.0\.0\.1:(\d+)/v1",
                                                          "".join(lines))}  # fmt: skip
            assert set(ports) == {"vllm-0", "vllm-1"}, "".join(lines)
            assert all(healthy(p) for p in ports.values())
            results = asyncio.run(_queries(nats_srv.url, 8))
            for msgs in results:
                assert msgs[-1]["v"] == "bear.done/1", msgs[-1]
                assert msgs[-1]["instance"] in ports and msgs[-1]["usage"]["completion_tokens"] >= 1
                routed = [m for m in msgs if m["v"] == "bear.routed/1"]
                assert routed[-1]["ttft_method"] == "bea", routed[-1]  # the real engines' snapshots were used
                assert routed[-1]["model"] == "tiny"
            recs = [json.loads(ln) for ln in (work / "latest" / "outcomes-router-0.jsonl").read_text().splitlines()]
            assert {r["query_id"] for r in recs if r["status"] == "done"} >= {f"up-{i}" for i in range(8)}
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise
        assert rc == 0, "".join(lines)[-3000:]
        assert "stopped." in "".join(lines)
        # every vLLM (API server + engine core) is gone with the stack
        assert not any(healthy(p) for p in ports.values())
        assert _stack_rings() <= rings_before  # the plugin rings were removed
