"""The deployment as pods: deploy/local/up.sh builds the image and brings the cpu-sim overlay up as
podman pods, 200 queries are routed through the gateway with no error, a NATS pod and an estimator
pod are killed (SIGKILL) under load with every request answered or refused with a coded error and
none run twice, and deploy/local/down.sh leaves no pod, volume or network behind.

A router pod's kill is measured by ``deploy/local/bench.py faults`` but not asserted here: the
answers it was relaying when it died are lost with it (deploy/README.md, "Faults").

Needs podman (runc) and mmdebstrap: .ci/setup.sh installs them and sets BEAR_REQUIRE_PODMAN=1,
under which a missing podman fails this test instead of skipping it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bear.runtime.ports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "deploy" / "local"


def _podman_or_skip() -> None:
    if shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        if os.environ.get("BEAR_REQUIRE_PODMAN") == "1":
            pytest.fail("podman or mmdebstrap missing although BEAR_REQUIRE_PODMAN=1 (.ci/setup.sh installs them)")
        pytest.skip("podman and mmdebstrap not installed (apt-get install podman runc mmdebstrap)")


def _bench(env: dict[str, str], tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"{args[0]}.json"
    r = subprocess.run([sys.executable, str(LOCAL / "bench.py"), *args, "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    print(r.stdout, r.stderr)
    assert out.exists(), r.stderr
    return json.loads(out.read_text())


def test_deployment_routes_survives_pod_kills_and_leaves_nothing(tmp_path: Path) -> None:
    _podman_or_skip()
    run = tmp_path / "run"
    network = f"bear-test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "BEAR_DEPLOY_RUN": str(run), "BEAR_GATEWAY_PORT": str(free_port()),
           "BEAR_NETWORK": network, "PYTHON": os.environ.get("BEAR_IMAGE_PYTHON", sys.executable)}
    pods: list[str] = []
    try:
        up = subprocess.run(["bash", str(LOCAL / "up.sh")], env=env, capture_output=True, text=True, timeout=1200)
        print(up.stdout, up.stderr)
        assert up.returncode == 0, up.stderr
        assert "BEAR is up" in up.stdout
        pods = (run / "pods").read_text().split()
        assert len(pods) == 14 and "gateway" in pods and "nats-2" in pods

        # without a fault, too, only what holds however the host times it: every request answered or
        # refused with a coded error, none left waiting (CI's loaded host once gave 4 of 200 a 503)
        load = _bench(env, tmp_path, "load", "--n", "200", "--rate", "4")
        assert load["sent"] == 200 and load["unanswered"] == 0 and load["answered"] >= 1, load["errors"]
        assert all(k.split(":", 1)[0] in ("429", "503", "504") and k.split(":", 1)[1] for k in load["errors"]), load
        assert len(load["instances"]) >= 1

        # across a kill every request gets its answer or a coded error (how many errors depends on
        # the host's timing: bench.py reports them), none is left waiting, none runs twice
        faults = _bench(env, tmp_path, "faults", "--kill", "nats", "estimator", "--rate", "4", "--duration", "30")
        for what in ("nats", "estimator"):
            f = faults[what]
            assert f["sent"] == 120 and f["unanswered"] == 0 and f["duplicated"] == 0, (what, f)
            assert all(k.split(":", 1)[0] in ("429", "500", "502", "503", "504") and k.split(":", 1)[1]
                       for k in f["errors"]), (what, f["errors"])
    finally:
        down = subprocess.run(["bash", str(LOCAL / "down.sh")], env=env, capture_output=True, text=True, timeout=300)
        print(down.stdout, down.stderr)
    assert down.returncode == 0, down.stderr
    assert not run.exists()
    conf = {**os.environ, "CONTAINERS_CONF": str(LOCAL / "containers.conf")}
    left = subprocess.run(["podman", "network", "exists", network], env=conf).returncode
    assert left != 0, f"network {network} left behind"
    for pod in pods:
        assert subprocess.run(["podman", "pod", "exists", pod], env=conf).returncode != 0, f"pod {pod} left behind"
