"""Turn the rendered Kubernetes manifests (``kubectl kustomize deploy/k8s/overlays/cpu-sim``) into
what ``podman kube play`` (4.3) runs: Pods and ConfigMaps on one DNS-enabled network.

What podman does not implement is mapped, never silently lost (deploy/README.md):

- ``StatefulSet`` of N: N Pods ``<name>-<k>`` (hostname the same); ``<name>-<k>.<service>`` (the
  headless Service's per-pod name) is rewritten to ``<name>-<k>`` in every argument, environment
  value and ConfigMap; volume claim templates become emptyDir volumes.
- ``Deployment`` of N: one Pod named after it (N = 1: the name its Service resolves to), else N
  Pods ``<name>-<k>``; ``--replicas name=N`` overrides N (estimators 1 → 3).
- ``Job``: one Pod with its restart policy (OnFailure).
- ``Service``, ``NetworkPolicy``, ``Namespace``: dropped — pods reach each other by pod name, and
  nothing but the gateway is published to the host (``--gateway-port``, on 127.0.0.1 only: podman
  would publish every declared container port, so the others are taken out).
- ``Secret`` volumes and ``secretKeyRef`` environment: podman 4.3 writes a kube Secret's ``data``
  into the pod still base64-encoded, so each Secret is the directory ``<secrets>/<name>`` made by
  deploy/make_secrets.py, mounted read-only (hostPath), and a ``secretKeyRef`` is its file's content.
- ``emptyDir``: podman makes it a named volume called as the pod's volume, which every pod with a
  volume of that name would share; each becomes ``<pod>-<volume>``.
- readiness probes: dropped (podman 4.3 has none); the runner waits for an answer end to end.

Usage: ``python podman_play.py RENDERED.yaml --secrets DIR [--gateway-port P] [--replicas estimator=3]
> play.yaml``; the pod names, in the order played, go to ``--names FILE``."""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

DROPPED = ("Service", "NetworkPolicy", "Namespace")


def _walk_strings(obj: Any, fn: Any) -> Any:
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, list):
        return [_walk_strings(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: _walk_strings(v, fn) for k, v in obj.items()}
    return obj


def _pod(name: str, template: dict[str, Any], restart: str, secrets: Path, hostname: str | None = None,
         host_secrets: Path | None = None) -> dict[str, Any]:
    spec = copy.deepcopy(template.get("spec", {}))
    spec["restartPolicy"] = restart
    if hostname:
        spec["hostname"] = hostname
    for vol in spec.get("volumes", []):
        if "secret" in vol:
            secret = vol.pop("secret")["secretName"]
            if not (secrets / secret).is_dir():
                raise SystemExit(f"error: no secret directory {secrets / secret} (run deploy/make_secrets.py)")
            vol["hostPath"] = {"path": str((host_secrets or secrets.resolve()) / secret), "type": "Directory"}
    # podman makes an emptyDir a named volume called as the pod's volume: "tmp" would be one
    # volume shared by every pod — each gets its own, <pod>-<volume>
    own = {v["name"]: f"{name}-{v['name']}" for v in spec.get("volumes", []) if "emptyDir" in v}
    for v in spec.get("volumes", []):
        v["name"] = own.get(v["name"], v["name"])
    for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        for m in c.get("volumeMounts", []):
            m["name"] = own.get(m["name"], m["name"])
        c.pop("readinessProbe", None)
        c.pop("ports", None)  # podman publishes a declared port on the host: only the gateway's is, below
        for e in c.get("env", []):
            ref = e.get("valueFrom", {})
            if "secretKeyRef" in ref:
                r = ref["secretKeyRef"]
                e["value"] = (secrets / r["name"] / r["key"]).read_text().strip()
                del e["valueFrom"]
            elif ref.get("fieldRef", {}).get("fieldPath") == "metadata.name":
                e["value"] = name
                del e["valueFrom"]
    labels = dict(template.get("metadata", {}).get("labels", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


def translate(docs: list[dict[str, Any]], secrets: Path, gateway_port: int = 0,
              replicas: dict[str, int] | None = None,
              host_secrets: Path | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """(the objects to play, notes on what was mapped): ConfigMaps, then the StatefulSets' pods,
    the Jobs', the Deployments' (NATS before what connects to it). ``host_secrets``: where the
    host sees ``secrets`` (when this runs in a container)."""
    order = {"ConfigMap": 0, "StatefulSet": 1, "Job": 2}
    docs = sorted(docs, key=lambda d: order.get(d.get("kind", ""), 3))
    replicas = replicas or {}
    renames: dict[str, str] = {}
    for d in docs:
        if d.get("kind") == "StatefulSet":
            name, svc = d["metadata"]["name"], d["spec"].get("serviceName", d["metadata"]["name"])
            for k in range(int(d["spec"].get("replicas", 1))):
                renames[f"{name}-{k}.{svc}"] = f"{name}-{k}"
    pattern = re.compile("|".join(re.escape(k) for k in sorted(renames, key=len, reverse=True))) if renames else None

    def rewrite(s: str) -> str:
        return pattern.sub(lambda m: renames[m.group(0)], s) if pattern else s

    out: list[dict[str, Any]] = []
    notes: list[str] = []
    for d in docs:
        kind, name = d.get("kind"), d.get("metadata", {}).get("name", "")
        if kind in DROPPED:
            notes.append(f"{kind}/{name}: not implemented by podman (pods reach each other by pod name)")
        elif kind == "ConfigMap":
            out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": d.get("data", {})})
        elif kind == "StatefulSet":
            tpl = copy.deepcopy(d["spec"]["template"])
            for claim in d["spec"].get("volumeClaimTemplates", []):
                tpl["spec"].setdefault("volumes", []).append({"name": claim["metadata"]["name"], "emptyDir": {}})
            n = int(d["spec"].get("replicas", 1))
            out += [_pod(f"{name}-{k}", tpl, "Always", secrets, hostname=f"{name}-{k}", host_secrets=host_secrets)
                    for k in range(n)]
            notes.append(f"StatefulSet/{name}: {n} pods {name}-0..{n - 1} (claims as emptyDir)")
        elif kind == "Deployment":
            n = replicas.get(name, int(d["spec"].get("replicas", 1)))
            names = [name] if n == 1 else [f"{name}-{k}" for k in range(n)]
            out += [_pod(p, d["spec"]["template"], "Always", secrets, host_secrets=host_secrets) for p in names]
        elif kind == "Job":
            tpl = d["spec"]["template"]
            out.append(_pod(name, tpl, tpl.get("spec", {}).get("restartPolicy", "OnFailure"), secrets,
                            host_secrets=host_secrets))
        else:
            raise SystemExit(f"error: {kind}/{name}: no podman mapping for this kind")
    if gateway_port:
        for p in out:
            if p["kind"] == "Pod" and p["metadata"]["name"] == "gateway":
                p["spec"]["containers"][0]["ports"] = [{"containerPort": 8000, "hostPort": gateway_port,
                                                         "hostIP": "127.0.0.1"}]
        notes.append(f"gateway: published on 127.0.0.1:{gateway_port}")
    return [_walk_strings(o, rewrite) for o in out], notes


def volumes(objs: list[dict[str, Any]]) -> list[str]:
    """The named volumes podman makes for ``objs``: one per emptyDir and one per ConfigMap used."""
    out: dict[str, None] = {}
    for o in objs:
        for v in o.get("spec", {}).get("volumes", []) if o["kind"] == "Pod" else []:
            if "emptyDir" in v:
                out[v["name"]] = None
            elif "configMap" in v:
                out[v["configMap"]["name"]] = None
    return list(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rendered", type=Path)
    ap.add_argument("--secrets", type=Path, required=True, help="deploy/make_secrets.py's files/ directory")
    ap.add_argument("--host-secrets", type=Path, help="where the host sees --secrets (this run in a container)")
    ap.add_argument("--gateway-port", type=int, default=0, help="publish the gateway on 127.0.0.1:PORT")
    ap.add_argument("--replicas", action="append", default=[], metavar="NAME=N", help="a Deployment's pod count")
    ap.add_argument("--names", type=Path, help="write the pod names here, one per line, in play order")
    ap.add_argument("--volumes", type=Path, help="write the volumes podman will make here (down.sh removes them)")
    a = ap.parse_args(argv)
    try:
        reps = {k: int(v) for k, v in (r.split("=", 1) for r in a.replicas)}
    except ValueError:
        print("error: --replicas takes NAME=N, e.g. estimator=3", file=sys.stderr)
        return 2
    docs = [d for d in yaml.safe_load_all(a.rendered.read_text()) if d]
    objs, notes = translate(docs, a.secrets, a.gateway_port, reps, a.host_secrets)
    for n in notes:
        print(n, file=sys.stderr)
    sys.stdout.write(yaml.safe_dump_all(objs, sort_keys=False))
    if a.names:
        a.names.write_text("".join(o["metadata"]["name"] + "\n" for o in objs if o["kind"] == "Pod"))
    if a.volumes:
        a.volumes.write_text("".join(v + "\n" for v in volumes(objs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
