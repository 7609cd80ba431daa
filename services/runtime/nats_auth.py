"""Least-privilege NATS authorization for a BEAR deployment: which identity may publish and
subscribe to what, and the server configuration that enforces it (``bear up`` generates one per
run; ``bear nats config`` writes one for a deployment).

Every identity subscribes only to its own inbox prefix (``_INBOX_<name>.>``), so nobody reads
another's replies; a client submits only on its own ``bear.submit.<name>``, which routers answer
only into that inbox prefix (issue 26). The predictor and the estimator answer only through *response permissions*
(``allow_responses``: a reply subject they were sent, once); the routers — trusted with every
prompt anyway — may publish into the client applications' inboxes (``_INBOX_<client>.>``) and
nobody else may. Response permissions would not do for the routers: they are state of one server
connection, so after a reconnect (a NATS restart, a cluster node lost) the new server refuses the
rest of every answer in flight — the cluster test lost streams that way. Each instance publishes only its own deltas,
snapshots, batch records, prefix-cache events and registry key, and answers (response permissions) only the resync
requests for itself. JetStream API rights name the exact streams a part uses and never
include deleting, purging or reconfiguring one: only ``admin`` (``bear up`` itself, or the
operator's provisioning step) creates the KV buckets. The subjects each rule came from were found
by watching a real nats-server serve nats-py's KV calls (tests/security).

The predictor and the estimator subscribe to their request subjects only as members of their
queue group (a ``"<subject> <queue>"`` subscribe permission: a plain subscription, or one in any
other group — which would get a copy of every request — is refused), so a leaked service
credential sees its share of the prompts and answers only those, never all of them first
(issue 40). Where a deployment runs several replicas of a service, each gets its own identity
(``<service>-<k>``: ``replicas``), so a leaked one is revoked alone (``revoke``)."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bear.protocol.subjects import ESTIMATOR_QUEUE, PREDICTOR_QUEUE, Subjects
from bear.runtime.identity import Identity, new_identity

ACCOUNT = "BEAR"
SERVICES = ("router", "predictor", "estimator", "calibrator", "gateway", "client")
INSTANCE_PREFIX = "instance-"
SHARED_CLIENT = "client"  # the identity every command in a `bear up` directory shares (shared_client_note)


def shared_client_note(auth_dir: str | Path = "<auth>") -> str:
    """What the shared ``client`` identity lets its holders do, and how to give each user their
    own (issue 40: a second user of the same identity read 840 messages of another's streams) —
    printed where it is made (``bear up``'s banner, ``bear nats config``) and in auth.conf."""
    return (f"`{SHARED_CLIENT}` is one identity for every command run with it (in the `bear up` directory: all of "
            f"them): each can subscribe to its whole inbox prefix `_INBOX_{SHARED_CLIENT}.>` and so read the answers "
            f"streamed to the others. Give each user or application its own: `bear up --client alice` (or `bear nats "
            f"config --client alice`), then `bear submit --nats-creds {auth_dir}/alice.json …`")
REPLICATED = ("predictor", "estimator")  # services whose replicas may each have an identity of their own


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    responses: dict[str, Any] | bool = False  # allow_responses: False, True (one reply) or {max, expires}
    full: bool = False  # admin: everything

    def as_config(self) -> dict[str, Any]:
        if self.full:
            return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
        out: dict[str, Any] = {}
        if self.publish:
            out["publish"] = {"allow": list(self.publish)}
        elif not self.responses:  # with allow_responses and no publish list, the server denies the rest
            out["publish"] = {"deny": [">"]}
        out["subscribe"] = {"allow": list(self.subscribe)}
        if self.responses:
            out["allow_responses"] = self.responses
        return out


def _kv_read(bucket: str) -> list[str]:
    """Open a bucket and watch every key (nats-py ``key_value`` + ``watchall``: stream info, an
    ordered push consumer, its info, its deletion on stop, flow-control replies)."""
    s = f"KV_{bucket}"
    return [f"$JS.API.STREAM.INFO.{s}", f"$JS.API.CONSUMER.CREATE.{s}", f"$JS.API.CONSUMER.CREATE.{s}.>",
            f"$JS.API.CONSUMER.INFO.{s}.*", f"$JS.API.CONSUMER.DELETE.{s}.*", f"$JS.FC.{s}.>"]


def _kv_write(bucket: str, key: str = "*") -> list[str]:
    """Open a bucket and put, create or delete ``key`` (all three are publishes to ``$KV``)."""
    return [f"$JS.API.STREAM.INFO.KV_{bucket}", f"$KV.{bucket}.{key}"]


def _kv_claim(bucket: str) -> list[str]:
    """Create-only puts (``kv.create``: on a conflict nats-py reads the key's last entry)."""
    s = f"KV_{bucket}"
    return [*_kv_write(bucket), f"$JS.API.STREAM.MSG.GET.{s}", f"$JS.API.DIRECT.GET.{s}", f"$JS.API.DIRECT.GET.{s}.>"]


def _terminal_read(bucket: str) -> str:
    """Read one key of the terminal-message bucket with a direct get (``$JS.API.DIRECT.GET.<stream>.<subject>``:
    the subject form only — the form without a subject, which gets any message by sequence, is
    not granted, so a client reads only keys it knows: hashes of its own private inboxes)."""
    return f"$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.*"


def _obj_read(bucket: str) -> list[str]:
    """Open an object store and get objects (nats-py ``object_store`` + ``get``: stream info, the
    object's last meta message, the stream of its chunk subject looked up by name, an ordered push
    consumer over its chunks)."""
    s = f"OBJ_{bucket}"
    return ["$JS.API.STREAM.NAMES", f"$JS.API.STREAM.INFO.{s}", f"$JS.API.STREAM.MSG.GET.{s}", f"$JS.API.DIRECT.GET.{s}",
            f"$JS.API.DIRECT.GET.{s}.>", f"$JS.API.CONSUMER.CREATE.{s}", f"$JS.API.CONSUMER.CREATE.{s}.>",
            f"$JS.API.CONSUMER.INFO.{s}.*", f"$JS.API.CONSUMER.DELETE.{s}.*", f"$JS.FC.{s}.>"]


def _obj_write(bucket: str, name: str) -> list[str]:
    """Look an object up and put the one named ``name`` (chunks, then its meta message, whose
    subject is the name in URL-safe base64 as nats-py writes it): a writer may not replace anyone
    else's object (issue 26). Chunk subjects are random ids, so any writer may add chunks — the
    store's ``max_bytes`` bounds them (bear.runtime.kv.StoreLimits); readers still check that a
    bundle's content hashes to the id they asked for (bear.tokenizer.store.get_bundle)."""
    s = f"OBJ_{bucket}"
    meta = base64.urlsafe_b64encode(name.encode()).decode()
    return [f"$JS.API.STREAM.INFO.{s}", f"$JS.API.STREAM.MSG.GET.{s}", f"$JS.API.DIRECT.GET.{s}",
            f"$JS.API.DIRECT.GET.{s}.>", f"$O.{bucket}.C.>", f"$O.{bucket}.M.{meta}"]


def permissions(role: str, name: str, subjects: Subjects | None = None, instance: str | None = None,
                clients: tuple[str, ...] = ("client", "gateway")) -> Permissions:
    """The rights of identity ``name`` in ``role`` (admin, router, predictor, estimator, calibrator,
    gateway, client, instance — the last with its ``instance`` id); ``clients``: the client
    applications' identities, whose inboxes the routers answer."""
    s = subjects or Subjects()
    p = s.prefix
    inbox = f"_INBOX_{name}.>"
    if role == "admin":
        return Permissions(full=True)
    if role == "router":
        return Permissions(
            publish=(s.predict, s.estimate, f"{s.estimate}.*", s.dispatch_all, s.outcome_all,
                     *_kv_claim(s.queries_bucket), *_kv_read(s.instances_bucket), *_kv_read(s.calibration_bucket),
                     *_kv_read(s.provisioned_bucket), *_obj_read(s.tokenizers_bucket),
                     f"$KV.{s.terminals_bucket}.*",  # terminal records (published, not acked)
                     s.router_alive_all,  # is the router that accepted a query still there (takeover)
                     *(f"_INBOX_{c}.>" for c in clients)),
            subscribe=(s.submit, s.submit_all, s.cancel, s.outcome_all, s.router_alive_all, inbox),
            responses=True)  # its answer to another router's alive probe
    if role == "predictor":  # its requests only as a member of the queue group (issue 40)
        return Permissions(subscribe=(f"{s.predict} {PREDICTOR_QUEUE}", "$SRV.>", inbox), responses=True)
    if role == "estimator":
        return Permissions(
            publish=(*_kv_read(s.instances_bucket), *_kv_read(s.calibration_bucket), s.kv_resync("*"), s.resync("*")),
            subscribe=(f"{s.estimate} {ESTIMATOR_QUEUE}", f"{s.estimate}.* {ESTIMATOR_QUEUE}", s.delta_all,
                       s.snapshot_all, s.dispatch_all, s.kv_all, "$SRV.>", inbox),
            responses=True)
    if role == "calibrator":  # reads an instance's entry too: a profiled calibration is the refit's prior
        return Permissions(publish=tuple(_kv_claim(s.calibration_bucket)),
                           subscribe=(s.batches_all, s.outcome_all, inbox))
    if role == "gateway":
        return Permissions(publish=(s.submit_as(name), s.cancel, *_kv_read(s.instances_bucket),
                                    _terminal_read(s.terminals_bucket)), subscribe=(inbox,))
    if role == "client":  # its own submit subject: routers answer it only into its own inbox (issue 26)
        return Permissions(publish=(s.submit_as(name), s.cancel, _terminal_read(s.terminals_bucket)),
                           subscribe=(inbox,))
    if role == "instance":
        if not instance:
            raise ValueError("an instance identity needs its instance id")
        return Permissions(publish=(s.delta(instance), s.snapshot(instance), s.batches(instance), s.kv(instance),
                                    *_kv_write(s.instances_bucket, instance),
                                    *_obj_write(s.tokenizers_bucket, instance)),
                           subscribe=(s.resync(instance), s.kv_resync(instance), inbox),
                           responses=True)  # resync answers
    raise ValueError(f"unknown role {role!r} (admin, {', '.join(SERVICES)}, instance); prefix {p}")


def instance_identity_name(instance: str) -> str:
    return f"{INSTANCE_PREFIX}{instance}"


def replica_identity_name(service: str, k: int) -> str:
    """The identity of replica ``k`` of a replicated service (``estimator-1``)."""
    return f"{service}-{k}"


def replica_names(service: str, replicas: int) -> list[str]:
    """The identities of ``replicas`` replicas of ``service``: the service's own name for one
    (what a deployment of one replica always had), else ``<service>-0 …``."""
    return [service] if replicas <= 1 else [replica_identity_name(service, k) for k in range(replicas)]


_REPLICA = re.compile(r"^(predictor|estimator)-\d+$")


def is_service_name(name: str) -> bool:
    """``name`` is (or would be) a service's identity: not free for a client application."""
    return name in ("admin", *SERVICES[:4]) or name.startswith(INSTANCE_PREFIX) or bool(_REPLICA.match(name))


@dataclass
class AuthFiles:
    """What ``generate`` wrote: the server's authorization block and one identity file each."""

    directory: Path
    config: Path  # an ``accounts { … }`` block: include it in, or pass it as, the server config
    creds: dict[str, Path] = field(default_factory=dict)  # identity name → its file

    def path(self, name: str) -> Path:
        return self.creds[name]

    def instance(self, instance: str) -> Path:
        return self.creds[instance_identity_name(instance)]


def _conf_value(v: Any) -> str:
    """A value in nats-server's configuration syntax: JSON strings (quoted, so ``$JS`` is never
    read as a variable), lists and maps with bare keys."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k}: {_conf_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_conf_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def server_config(users: list[tuple[Identity, Permissions]]) -> str:
    """The ``accounts`` block: account BEAR (JetStream on) with one nkey user per identity.
    Connections without an identity are refused (no ``no_auth_user``)."""
    lines = ["# BEAR NATS authorization (bear.runtime.nats_auth): one nkey user per identity.",
             "# Generated; the public keys only — each identity's seed is in its own 0600 file.",
             "accounts {", f"  {ACCOUNT} {{", "    jetstream: enabled", "    users: ["]
    for ident, perms in users:
        lines.append(f"      # {ident.name}" + (" — shared by every command that uses it: each reads the others' answers; "
                                                  "one identity per user instead (--client NAME)"
                                                  if ident.name == SHARED_CLIENT else ""))
        lines.append(f"      {{ nkey: {json.dumps(ident.public_key)}, permissions: {_conf_value(perms.as_config())} }}")
    lines += ["    ]", "  }", "}", ""]
    return "\n".join(lines)


def plan(instances: list[str], clients: tuple[str, ...] = ("client", "gateway"),
         services: tuple[str, ...] = ("router", "predictor", "estimator", "calibrator"),
         replicas: Mapping[str, int] | None = None) -> list[tuple[str, str, str | None]]:
    """(identity name, role, instance id) of a deployment: admin, each service (one identity
    per replica where ``replicas`` asks for several: ``replica_names``), each client application
    (role client, or gateway for ``gateway``), each instance."""
    bad = sorted(set(replicas or {}) - set(REPLICATED))
    if bad:
        raise ValueError(f"replicas of {', '.join(bad)}: only {', '.join(REPLICATED)} have replica identities")
    out: list[tuple[str, str, str | None]] = [("admin", "admin", None)]
    out += [(name, svc, None) for svc in services for name in replica_names(svc, (replicas or {}).get(svc, 1))]
    out += [(c, "gateway" if c == "gateway" else "client", None) for c in clients]
    out += [(instance_identity_name(i), "instance", i) for i in instances]
    return out


def generate(directory: Path, instances: list[str], subjects: Subjects | None = None, *,
             clients: tuple[str, ...] = ("client", "gateway"), replicas: Mapping[str, int] | None = None) -> AuthFiles:
    """Fresh identities for ``instances`` and every service (plus ``clients``; per replica where
    ``replicas`` asks for several, e.g. ``{"estimator": 2}``: ``estimator-0``, ``estimator-1``)
    under ``directory`` (mode 0700; files 0600), and ``auth.conf``, the server's accounts block."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)
    files = AuthFiles(directory, directory / "auth.conf")
    users = []
    for name, role, inst in plan(instances, clients, replicas=replicas):
        ident = new_identity(name)
        files.creds[name] = ident.save(directory / f"{name}.json")
        users.append((ident, permissions(role, name, subjects, inst, (*clients, "admin"))))  # admin probes too
    fd_path = files.config
    fd_path.write_text(server_config(users))
    fd_path.chmod(0o600)
    return files


def revoke(files: AuthFiles, names: Iterable[str]) -> list[str]:
    """Take identities out of the server's accounts block (and delete their files): a leaked
    replica's credential is revoked alone, the other replicas keep theirs. The server applies it
    on a configuration reload (``nats-server --signal reload``, SIGHUP: ``LocalNatsServer.reload``),
    which closes the revoked identity's connections; a replacement replica needs a fresh identity.
    Returns the names that were taken out."""
    drop = set(names)
    lines = files.config.read_text().splitlines()
    out: list[str] = []
    gone: list[str] = []
    skip = False
    for line in lines:
        if skip:  # the user entry after the comment naming it (server_config writes one line each)
            skip = False
            continue
        head = line.strip()
        name = head[2:].split(" ", 1)[0] if head.startswith("# ") else ""  # "# <name>[ — a note]"
        if name in drop and line.startswith("      #"):
            gone.append(name)
            skip = True
            continue
        out.append(line)
    files.config.write_text("\n".join(out) + "\n")
    files.config.chmod(0o600)
    for name in gone:
        path = files.creds.pop(name, None)
        if path is not None:
            path.unlink(missing_ok=True)
    return gone
