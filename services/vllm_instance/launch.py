"""One real vLLM instance with the BEAR scheduler plugin, as a child process: the interpreter (a
separate venv, BEAR_VLLM_PYTHON), the command line and environment, the tiny local Qwen3 model for
CPU runs, and a small process handle. Shared by ``bear up --backend vllm`` (``bear.stack.stack``)
and the real-vLLM tests (``tests/vllm/harness.py``). vLLM's dependencies never enter BEAR's
environment: the plugin folder (``services/snapshotter``) is put on vLLM's ``PYTHONPATH``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bear.runtime.ports import free_port

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "snapshotter"  # bear_vllm_plugin.py + shm.py
TINY_MODEL_SCRIPT = Path(__file__).resolve().parent / "tiny_model.py"
DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "bear" / "vllm-venv" / "bin" / "python"


def check_vllm_python(path: str) -> str:
    """``path`` if it is an interpreter that imports vLLM; a RuntimeError saying why not otherwise."""
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"vLLM python {path} is not an executable (install: .ci/install-vllm.sh)")
    res = subprocess.run([path, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"vLLM python {path} cannot import vllm:\n{res.stderr[-2000:]}")
    return path


def vllm_python() -> str | None:
    """The vLLM interpreter of the tests: None when BEAR_VLLM_PYTHON is unset (they skip); set but
    unusable is an error, never a skip."""
    path = os.environ.get("BEAR_VLLM_PYTHON")
    return check_vllm_python(path) if path else None


def default_vllm_python() -> str:
    """BEAR_VLLM_PYTHON, else ~/.cache/bear/vllm-venv/bin/python (what .ci/install-vllm.sh makes)."""
    return check_vllm_python(os.environ.get("BEAR_VLLM_PYTHON") or str(DEFAULT_VLLM_PYTHON))


def make_tiny_model(python: str, out: Path) -> Path:
    """Write the tiny random Qwen3 model to ``out`` with the vLLM venv's Python (once)."""
    if not (out / "model.safetensors").exists():
        subprocess.run([python, str(TINY_MODEL_SCRIPT), str(out)], check=True, timeout=300)
    return out


def kv_events_args(stem: str) -> list[str]:
    """vLLM's KV cache events on local ZMQ sockets named after ``stem`` (the plugin's ring name),
    with a replay buffer, so that the snapshotter can mirror the prefix cache (docs/snapshotter.md)."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc:///tmp/{stem}-kv",
           "replay_endpoint": f"ipc:///tmp/{stem}-kv-replay", "topic": "kv", "buffer_steps": 10_000}
    return ["--kv-events-config", json.dumps(cfg)]


def vllm_command(python: str, model: Path | str, port: int, served_name: str, args: Sequence[str], *,
                 kv_events: str | None = None) -> list[str]:
    """The command line; ``kv_events``: publish KV cache events on sockets named after it (unless
    ``args`` configures them already)."""
    extra = kv_events_args(kv_events) if kv_events and "--kv-events-config" not in args else []
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
        "--scheduler-cls", "bear_vllm_plugin.make_scheduler", "--disable-log-stats", *extra, *args,
    ]  # fmt: skip


def vllm_env(shm: str, kv_gib: str = "1") -> dict[str, str]:
    """Environment of a vLLM process: the plugin on PYTHONPATH, its ring name, offline, CPU KV space."""
    return {**os.environ, **vllm_env_overrides(shm, kv_gib)}


def vllm_env_overrides(shm: str, kv_gib: str = "1") -> dict[str, str]:
    return {
        "PYTHONPATH": str(PLUGIN_DIR),
        "BEAR_SNAPSHOT_SHM": shm,
        "VLLM_CPU_KVCACHE_SPACE": kv_gib,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def remove_shm(name: str) -> None:
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


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
    served_name: str = "tiny"
    env: dict[str, str] = field(default_factory=dict)  # extra environment (e.g. BEAR_SNAPSHOT_VERIFY=1)
    kv_events: bool = True  # publish KV cache events (the snapshotter mirrors the prefix cache)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 600) -> VllmServer:
        cmd = vllm_command(self.python, self.model, self.port, self.served_name, self.args,
                           kv_events=self.shm if self.kv_events else None)
        with open(self.log_path or os.devnull, "ab") as log:
            self.proc = subprocess.Popen(cmd, env={**vllm_env(self.shm, self.kv_gib), **self.env}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; log: {self.log_path}")
            if healthy(self.port):
                return self
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
        remove_shm(self.shm)
        for suffix in ("-kv", "-kv-replay"):  # the KV-event sockets (ipc files)
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/{self.shm}{suffix}")
