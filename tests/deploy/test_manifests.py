"""deploy/ as a platform team applies it: the kustomize overlays render to objects that validate
against the Kubernetes API schemas (strict: no unknown field), every Secret they name is one that
deploy/make_secrets.py makes, and the podman mapping (deploy/local/podman_play.py) keeps every pod,
publishes only the gateway and gives each pod its own emptyDir volumes."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-sim", "gpu")
KUBERNETES = "1.37"  # a current release: the newest schemas kubernetes-validate ships


def _script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


def rendered(overlay: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / "rendered" / f"{overlay}.yaml").read_text()) if d]


def _secret_refs(obj: Any) -> set[str]:
    """Every Secret an object names (volumes and secretKeyRef)."""
    out: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("secret",) and isinstance(v, dict) and "secretName" in v:
                out.add(v["secretName"])
            elif k == "secretKeyRef" and isinstance(v, dict):
                out.add(v["name"])
            else:
                out |= _secret_refs(v)
    elif isinstance(obj, list):
        for v in obj:
            out |= _secret_refs(v)
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_objects_validate_against_the_api_schemas(overlay: str) -> None:
    docs = rendered(overlay)
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["ConfigMap", "Deployment", "Job", "Namespace", "NetworkPolicy", "Service", "StatefulSet"]
    for d in docs:
        kubernetes_validate.validate(d, KUBERNETES, strict=True)  # raises ValidationError naming the field
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "bear", d["metadata"]["name"]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for want in ("nats", "estimator", "router", "predictor", "calibrator", "gateway"):
        assert any(n == want for _, n in names), want
    replicas = {d["metadata"]["name"]: d["spec"].get("replicas") for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    assert replicas["nats"] == 3 and replicas["estimator"] == 2 and replicas["router"] == 2
    assert sum(1 for d in docs if d["kind"] == "Deployment" and
               d["spec"]["template"]["metadata"]["labels"].get("bear/role") == "instance") == 3


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_named_is_one_make_secrets_makes(overlay: str, tmp_path: Path) -> None:
    make = _script(ROOT / "deploy" / "make_secrets.py")
    docs = rendered(overlay)
    binds = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "bear-instances")
    import json

    instances = list(json.loads(binds["data"]["instances.json"]))
    made = make.secret_files(tmp_path, instances, [])
    needed = set().union(*(_secret_refs(d) for d in docs))
    assert needed <= set(made), sorted(needed - set(made))
    # each instance's engine and identity, and the routers' allow-list, name the same instances
    router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    allowed = [args[i + 1] for i, a in enumerate(args) if a == "--allow-base-url"]
    assert sorted(allowed) == sorted(json.loads(binds["data"]["instances.json"])[i]["base_url"] for i in instances)
    assert "--provisioning" in args


def test_renders_are_current() -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: cannot re-render deploy/k8s/overlays to compare")
    for overlay in OVERLAYS:
        now = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], check=True,
                             capture_output=True, text=True).stdout
        committed = (K8S / "rendered" / f"{overlay}.yaml").read_text().split("\n", 1)[1]
        assert now == committed, f"deploy/k8s/rendered/{overlay}.yaml is stale: re-render it (its first line says how)"


def test_podman_mapping_keeps_every_pod_and_publishes_only_the_gateway(tmp_path: Path) -> None:
    make = _script(ROOT / "deploy" / "make_secrets.py")
    play = _script(ROOT / "deploy" / "local" / "podman_play.py")
    docs = rendered("cpu-sim")
    make.write(tmp_path, make.secret_files(tmp_path, ["qwen0-6b-0", "qwen8b-0", "qwen32b-0"], []), "bear")
    objs, notes = play.translate(docs, tmp_path / "files", gateway_port=18080, replicas={"estimator": 3})
    pods = [o for o in objs if o["kind"] == "Pod"]
    names = [p["metadata"]["name"] for p in pods]
    assert names[:4] == ["nats-0", "nats-1", "nats-2", "nats-provision"]  # NATS first, then the Job
    assert sorted(names[4:]) == sorted(["calibrator", "estimator-0", "estimator-1", "estimator-2", "gateway",
                                        "predictor", "qwen0-6b-0", "qwen32b-0", "qwen8b-0", "router-0", "router-1"])
    assert any("NetworkPolicy/default-deny-ingress" in n for n in notes)
    text = yaml.safe_dump_all(objs)
    assert ".nats:" not in text  # every headless per-pod name became the pod's own
    seen: set[str] = set()
    for p in pods:
        spec = p["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            ports = c.get("ports", [])
            if p["metadata"]["name"] == "gateway":
                assert ports == [{"containerPort": 8000, "hostPort": 18080, "hostIP": "127.0.0.1"}]
            else:
                assert not ports
            for e in c.get("env", []):
                assert "valueFrom" not in e or "secretKeyRef" not in e["valueFrom"]
        for v in spec.get("volumes", []):
            assert "secret" not in v
            if "hostPath" in v:
                assert Path(v["hostPath"]["path"]).is_dir()
            if "emptyDir" in v:
                assert v["name"].startswith(p["metadata"]["name"] + "-") and v["name"] not in seen
                seen.add(v["name"])
    assert set(play.volumes(objs)) >= seen | {"nats-config", "bear-instances"}
    nats0 = pods[0]["spec"]["containers"][0]
    assert {"name": "POD_NAME", "value": "nats-0"} in nats0["env"]
    route_pw = (tmp_path / "files" / "bear-nats-route" / "password").read_text()
    assert {"name": "BEAR_ROUTE_PASSWORD", "value": route_pw} in nats0["env"]
