"""NATS identities: one nkey (Ed25519) per service and per instance.

Why nkeys and not user/password: the server's configuration holds only public keys (it can be
shipped in a ConfigMap or left readable), each process holds only its own seed, and the server
authenticates by challenge–response — no secret crosses the wire, which matters on the plain TCP
of loopback or of a cluster network without TLS.

An identity file (``bear.identity/1``, JSON, mode 0600) names the identity, its seed and its
private inbox prefix ``_INBOX_<name>``: the server lets the identity subscribe only below that
prefix, so nobody reads another identity's replies (bear.runtime.nats_auth). A process finds its
file in ``--nats-creds`` or ``$BEAR_NATS_CREDS`` (bear.runtime.service.connect)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bear.protocol import schemas
from bear.protocol.errors import BearError, ErrorCode

SCHEMA = schemas.IDENTITY
CREDS_ENV = "BEAR_NATS_CREDS"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # one NATS subject token: no dots, no wildcards


@dataclass(frozen=True)
class Identity:
    name: str
    seed: str  # the nkey seed, "SU…"
    public_key: str  # "U…": what the server's configuration lists

    @property
    def inbox_prefix(self) -> str:
        """The only subjects this identity may subscribe to for replies: ``<prefix>.>``."""
        return f"_INBOX_{self.name}"

    def connect_options(self) -> dict[str, Any]:
        """nats-py ``connect`` options that authenticate as this identity."""
        return {"nkeys_seed_str": self.seed, "inbox_prefix": self.inbox_prefix}

    def save(self, path: Path) -> Path:
        """Write the identity file, readable by this user only (0600, created that way)."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        body = json.dumps({"v": SCHEMA, "name": self.name, "public_key": self.public_key, "seed": self.seed,
                           "inbox_prefix": self.inbox_prefix}, indent=2)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body + "\n")
        os.chmod(path, 0o600)  # an existing file keeps its mode through O_TRUNC
        return path


def new_identity(name: str) -> Identity:
    """A fresh random user nkey named ``name`` (a subject token: letters, digits, ``-``, ``_``)."""
    import nkeys

    if not NAME.match(name):
        raise ValueError(f"identity name {name!r} must be 1-128 letters, digits, '-' or '_'")
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return Identity(name, seed.decode(), nkeys.from_seed(bytearray(seed)).public_key.decode())


def load_identity(path: str | Path) -> Identity:
    """The identity in ``path``; ``BearError(BAD_REQUEST)`` naming the file on anything wrong."""
    import nkeys

    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except OSError as exc:
        raise BearError(ErrorCode.BAD_REQUEST, f"cannot read NATS credentials {p}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise BearError(ErrorCode.BAD_REQUEST, f"NATS credentials {p} are not JSON: {exc}") from exc
    if not isinstance(d, dict) or d.get("v") != SCHEMA or not isinstance(d.get("seed"), str) \
            or not isinstance(d.get("name"), str) or not NAME.match(d["name"]):
        raise BearError(ErrorCode.BAD_REQUEST, f"NATS credentials {p} are not a {SCHEMA} file")
    try:
        public = nkeys.from_seed(bytearray(d["seed"].encode())).public_key.decode()
    except Exception as exc:  # nkeys raises its own error types on a damaged seed
        raise BearError(ErrorCode.BAD_REQUEST, f"NATS credentials {p}: invalid nkey seed") from exc
    return Identity(d["name"], d["seed"], public)


def creds_from_env() -> str | None:
    """``$BEAR_NATS_CREDS`` (a path), or None when unset or empty."""
    return os.environ.get(CREDS_ENV) or None


def own_name(creds: str | Path | None = None) -> str:
    """The name of the identity a process connects as (``creds``, else ``$BEAR_NATS_CREDS``):
    what a replicated service says it is in its replies (``estimator-1``); "" without one."""
    path = creds if creds is not None else creds_from_env()
    if not path:
        return ""
    try:
        return load_identity(path).name
    except BearError:
        return ""
