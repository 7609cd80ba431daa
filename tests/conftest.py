"""Shared fixtures: the public vLLM traces, a local NATS server on a random port, and for the
tests that run real vLLM (tests/vllm, the gateway's benchmark-client test) its interpreter and a
tiny local model."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bear.protocol.jsonl import read_jsonl
from bear.runtime.nats_server import LocalNatsServer
from bear.vllm_instance.launch import make_tiny_model, vllm_python

REPO = Path(__file__).resolve().parents[1]

# Under pytest-xdist, each worker's vLLM engines keep their OpenMP threads on a core of their own:
# vLLM's automatic binding reserves a core for other processes and puts every engine on the same
# remaining one, so two workers' engines would share it while the other core idles.
if "PYTEST_XDIST_WORKER" in os.environ and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _cores = sorted(os.sched_getaffinity(0))
    _k = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw") or 0)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_cores[_k % len(_cores)])
TRACES = REPO / "tests" / "data" / "vllm-cpu-traces"  # recorded from vLLM (CPU build): README there


def load_jsonl(path: Path) -> list[dict]:
    return list(read_jsonl(path))


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not (TRACES / "cases.jsonl.gz").exists():
        raise FileNotFoundError(f"public vLLM traces not found at {TRACES}")
    return TRACES


@pytest.fixture(scope="session")
def cases(traces_dir: Path) -> list[dict]:
    return load_jsonl(traces_dir / "cases.jsonl.gz")


@pytest.fixture(scope="session")
def sanitized_tool(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Build a libbea target with ASan+UBSan (``-DBEA_SANITIZE=ON``) and return its path. One
    build tree for the session: the fuzz drivers share the library, so it is configured and
    compiled once."""
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.fail("cmake and a C++ compiler are required (the project builds libbea with them)")
    build = tmp_path_factory.mktemp("sanitized-build")
    subprocess.run(["cmake", "-S", str(REPO), "-B", str(build), "-DBEA_SANITIZE=ON", "-DCMAKE_BUILD_TYPE=Debug"],
                   check=True, capture_output=True)  # fmt: skip

    def tool(target: str) -> Path:
        subprocess.run(["cmake", "--build", str(build), "-j2", "--target", target], check=True, capture_output=True)
        return build / target

    return tool


@pytest.fixture(scope="module")
def bear_up_ports() -> Iterator[None]:
    """Held by the modules that start ``bear up`` with its default ports (the gateway's 8000, the
    router's metrics 9464): a lock across pytest-xdist workers, so that two such stacks never run
    at once (the second would find the ports taken)."""
    with open(os.path.join(tempfile.gettempdir(), "bear-tests-default-ports.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture
def nats_server() -> Iterator[LocalNatsServer]:
    with LocalNatsServer() as srv:
        yield srv


@pytest.fixture(scope="session")
def vllm_py() -> str:
    py = vllm_python()
    if py is None:
        if os.environ.get("BEAR_REQUIRE_VLLM") == "1":  # .ci/test.sh installed it: a skip would hide a failure
            pytest.fail("BEAR_REQUIRE_VLLM=1 but BEAR_VLLM_PYTHON is not set or not runnable")
        pytest.skip("BEAR_VLLM_PYTHON is not set (CI sets it; locally: .ci/install-vllm.sh)")
    return py


@pytest.fixture(scope="session")
def tiny_model(vllm_py: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(vllm_py, tmp_path_factory.mktemp("tiny-qwen3"))
