"""A deployment's secrets, made once per deployment: the NATS identities (``bear nats config``'s
generator), the route password of the NATS cluster, one API key per engine and the gateway's key.

    python deploy/make_secrets.py --out secrets --instance qwen0-6b-0 --instance qwen8b-0 --instance qwen32b-0

writes ``secrets/secrets.yaml`` (one Kubernetes Secret per process, for ``kubectl apply -f``) and
the same files as ``secrets/files/<secret name>/<key>`` (0600; the local podman runner mounts
those directories: podman 4.3 writes a kube Secret's ``data`` into the pod still base64-encoded).
Every process gets only its own Secret (docs/security.md):

  bear-nats-auth            auth.conf           the NATS nodes' accounts block (public keys only)
  bear-nats-route           password            the NATS nodes' cluster route password
  bear-nats-<identity>      <identity>.json     one NATS identity (admin, router, estimator, …, instance-<id>)
  bear-engine-key-<id>      key                 the API key of one engine
  bear-engine-keys          engine-keys.json    {instance id: key}, for the routers
  bear-gateway-keys         keys                the gateway's client API key(s), one per line

Needs the ``bear-router`` package (run it with the Python that has it)."""

from __future__ import annotations

import argparse
import base64
import json
import secrets
import sys
from pathlib import Path

from bear.runtime.nats_auth import generate


def secret_files(out: Path, instances: list[str], clients: list[str]) -> dict[str, dict[str, bytes]]:
    """{secret name: {key: content}} of a fresh deployment (identities written under ``out/auth``)."""
    auth = generate(out / "auth", instances, clients=tuple(dict.fromkeys(("client", "gateway", *clients))))
    found: dict[str, dict[str, bytes]] = {
        "bear-nats-auth": {"auth.conf": auth.config.read_bytes()},
        "bear-nats-route": {"password": secrets.token_urlsafe(24).encode()},
    }
    for name, path in sorted(auth.creds.items()):
        found[f"bear-nats-{name}"] = {f"{name}.json": Path(path).read_bytes()}
    keys = {i: "bear-engine-" + secrets.token_urlsafe(24) for i in instances}
    for i, key in keys.items():
        found[f"bear-engine-key-{i}"] = {"key": key.encode()}
    found["bear-engine-keys"] = {"engine-keys.json": json.dumps(keys, indent=2).encode()}
    found["bear-gateway-keys"] = {"keys": ("sk-bear-" + secrets.token_urlsafe(24) + "\n").encode()}
    return found


def write(out: Path, found: dict[str, dict[str, bytes]], namespace: str) -> None:
    docs = []
    for name, items in found.items():
        d = out / "files" / name
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        for key, content in items.items():
            f = d / key
            f.write_bytes(content)
            f.chmod(0o600)
        data = {k: base64.b64encode(v).decode() for k, v in items.items()}
        docs.append(json.dumps({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                "metadata": {"name": name, "namespace": namespace}, "data": data}))
    y = out / "secrets.yaml"
    y.write_text("".join(f"---\n{d}\n" for d in docs))  # JSON documents are YAML documents
    y.chmod(0o600)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory to write (must not exist yet)")
    ap.add_argument("--instance", action="append", default=[], help="an instance id (repeatable)")
    ap.add_argument("--client", action="append", default=[], help="a client application (repeatable)")
    ap.add_argument("--namespace", default="bear", help="namespace of the Secrets (default bear)")
    a = ap.parse_args(argv)
    if not a.instance:
        print("error: name the deployment's instances: --instance ID (repeatable)", file=sys.stderr)
        return 2
    if a.out.exists():
        print(f"error: {a.out} exists: secrets are made once per deployment (remove it to start over)",
              file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, mode=0o700)
    write(a.out, secret_files(a.out, a.instance, a.client), a.namespace)
    print(f"secrets for {len(a.instance)} instances in {a.out}/secrets.yaml and {a.out}/files/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
