"""Run a real vLLM (CPU build) with the BEAR plugin, the snapshotter and a Poisson load; shared by
the tests in this folder. The vLLM Python comes from BEAR_VLLM_PYTHON (a separate venv made by
.ci/install-vllm.sh): vLLM's dependencies never enter the main environment."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "services" / "snapshotter"
TINY_MODEL = Path(__file__).with_name("tiny_model.py")


def vllm_python() -> str | None:
    """The vLLM interpreter, or None when BEAR_VLLM_PYTHON is unset (local dev: tests skip).
    Set but unusable is an error, never a skip."""
    path = os.environ.get("BEAR_VLLM_PYTHON")
    if not path:
        return None
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"BEAR_VLLM_PYTHON={path} is not an executable")
    res = subprocess.run(
        [path, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    )
    if res.returncode != 0:
        raise RuntimeError(f"BEAR_VLLM_PYTHON={path} cannot import vllm:\n{res.stderr[-2000:]}")
    return path


def make_tiny_model(python: str, out: Path) -> Path:
    if not (out / "model.safetensors").exists():
        subprocess.run([python, str(TINY_MODEL), str(out)], check=True, timeout=300)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmServer:
    python: str
    model: Path
    args: list[str]
    shm: str = field(default_factory=lambda: f"bear-vllm-{uuid.uuid4().hex[:8]}")
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    kv_gib: str = "1"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 600) -> VllmServer:
        env = {
            **os.environ,
            "PYTHONPATH": str(PLUGIN_DIR),
            "BEAR_SNAPSHOT_SHM": self.shm,
            "VLLM_CPU_KVCACHE_SPACE": self.kv_gib,
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
            "--scheduler-cls", "bear_vllm_plugin.make_scheduler", "--disable-log-stats",
            *self.args,
        ]  # fmt: skip
        log = open(self.log_path or os.devnull, "ab")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM did not become healthy in {timeout}s; log: {self.log_path}")

    def kill(self) -> None:
        """SIGKILL the whole process group (API server, engine core, worker)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        try:
            os.unlink(f"/dev/shm/{self.shm}")
        except FileNotFoundError:
            pass


@dataclass
class Load:
    """A Poisson stream of completions with random token-id prompts (ignore_eos: exact lengths)."""

    n: int
    rate: float
    prompt: tuple[int, int]
    output: tuple[int, int]
    seed: int = 0


async def run_load(base_url: str, load: Load) -> list[dict[str, Any]]:
    rng = random.Random(load.seed)
    results: list[dict[str, Any]] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        n_prompt = rng.randint(*load.prompt)
        body = {
            "model": "tiny",
            "prompt": [rng.randint(0, 255) for _ in range(n_prompt)],
            "max_tokens": rng.randint(*load.output),
            "ignore_eos": True,
            "temperature": 0.0,
        }
        t0 = time.monotonic()
        try:
            r = await client.post(f"{base_url}/completions", json=body, timeout=600)
            results.append({"i": i, "status": r.status_code, "latency": time.monotonic() - t0})
        except httpx.HTTPError as exc:
            results.append({"i": i, "status": -1, "error": repr(exc)})

    async with httpx.AsyncClient(
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    ) as client:
        tasks = []
        for i in range(load.n):
            tasks.append(asyncio.create_task(one(client, i)))
            await asyncio.sleep(rng.expovariate(load.rate))
        await asyncio.gather(*tasks)
    return results
