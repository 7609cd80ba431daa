"""One identity per replica (issue 40, item 3): what ``bear nats config --service-replicas``,
``bear up`` (``Stack``) and ``bear estimator --workers`` make and pass, so that a leaked replica is
revoked alone (its queue-group permissions and revocation against a real server:
tests/security/test_nats_permissions.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bear.estimator.service import worker_creds
from bear.runtime.identity import load_identity, own_name
from bear.runtime.nats_auth import generate, is_service_name, plan, replica_names, revoke
from bear.runtime.nats_server import LocalNatsServer
from bear.stack.stack import Stack, StackConfig

from waiting import HANG_S


def test_replica_names_keep_one_replica_as_it_was() -> None:
    assert replica_names("estimator", 1) == ["estimator"]
    assert replica_names("estimator", 3) == ["estimator-0", "estimator-1", "estimator-2"]
    names = [n for n, _, _ in plan([], replicas={"predictor": 2})]
    assert "predictor-0" in names and "predictor-1" in names and "predictor" not in names and "estimator" in names
    with pytest.raises(ValueError, match="router"):
        plan([], replicas={"router": 2})
    assert all(is_service_name(n) for n in ("estimator", "estimator-7", "predictor-0", "admin", "instance-a"))
    assert not any(is_service_name(n) for n in ("alice", "estimators", "estimator-x"))


def test_revoke_takes_out_only_the_named_identity(tmp_path: Path) -> None:
    files = generate(tmp_path / "auth", [], replicas={"estimator": 2})
    keys = {n: load_identity(p).public_key for n, p in files.creds.items()}
    assert revoke(files, ["estimator-1", "nobody"]) == ["estimator-1"]
    conf = files.config.read_text()
    assert keys["estimator-1"] not in conf and "# estimator-1" not in conf
    assert all(keys[n] in conf for n in keys if n != "estimator-1")
    assert revoke(files, ["client"]) == ["client"]  # its comment carries a note: still found
    assert keys["client"] not in files.config.read_text()


def test_nats_config_writes_one_identity_per_replica(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    subprocess.run([sys.executable, "-m", "bear", "nats", "config", "--out", str(out), "--service-replicas",
                    "estimator=2"], capture_output=True, text=True, timeout=HANG_S, check=True)
    assert (out / "estimator-0.json").exists() and (out / "estimator-1.json").exists()
    assert not (out / "estimator.json").exists() and (out / "predictor.json").exists()
    assert own_name(out / "estimator-1.json") == "estimator-1"
    for bad in (["--service-replicas", "router=2"], ["--client", "estimator-1"]):
        res = subprocess.run([sys.executable, "-m", "bear", "nats", "config", "--out", str(tmp_path / "x"), *bad],
                             capture_output=True, text=True, timeout=HANG_S, check=False)
        assert res.returncode != 0 and ("service-replicas" in res.stderr or "identity" in res.stderr)


def test_forked_workers_each_take_their_own_file() -> None:
    assert worker_creds("auth/estimator-{worker}.json", 2) == "auth/estimator-2.json"
    assert worker_creds("auth/estimator.json", 2) == "auth/estimator.json"  # shared, as before


def test_bear_up_starts_each_replica_as_its_own_identity(tmp_path: Path) -> None:
    stack = Stack(StackConfig(workdir=tmp_path, estimator_workers=2, predictors=2, predictor_dir=tmp_path))
    stack.plan()
    stack.nats = LocalNatsServer()  # a local server (not started): identities are generated for it
    try:
        stack._set_up_auth()
    finally:
        stack.nats.close()  # its temporary store
    ident = {n: c.identity for n, c in stack.children.items() if n.startswith(("predictor", "estimator"))}
    assert ident == {"predictor-0": "predictor-0", "predictor-1": "predictor-1", "estimator-0": "estimator-0",
                     "estimator-1": "estimator-1"}
    for name in ident:
        assert own_name(stack.children[name].env["BEAR_NATS_CREDS"]) == name
    one = Stack(StackConfig(workdir=tmp_path / "one", predictor_dir=tmp_path))
    one.plan()
    assert one.children["predictor"].identity == "predictor" and one.children["estimator-0"].identity == "estimator"
