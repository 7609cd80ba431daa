"""API keys of the gateway: ``Authorization: Bearer <key>``, keys from a file (one per line, ``#``
comments) and/or the ``BEAR_GATEWAY_API_KEYS`` environment variable (comma or whitespace
separated). Keys are kept only as SHA-256 digests and a presented key is compared by digest, so
neither the comparison's timing nor a memory dump gives a key away. Authentication is off only
when asked for explicitly, and then only on a loopback address."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import secrets
from collections.abc import Iterable
from pathlib import Path

ENV_KEYS = "BEAR_GATEWAY_API_KEYS"
MIN_KEY_CHARS = 16


class AuthConfigError(ValueError):
    """The key configuration cannot start a gateway (one line for the person starting it)."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str) -> list[str]:
    """Keys in a file's text or an environment value: comments and blank entries dropped."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        out.extend(k for k in re.split(r"[\s,]+", line) if k)
    return out


def load_keys(key_file: Path | None, env: dict[str, str] | None = None) -> list[str]:
    env = os.environ if env is None else env
    keys = parse_keys(env.get(ENV_KEYS, ""))
    if key_file is not None:
        try:
            keys += parse_keys(key_file.read_text())
        except OSError as exc:
            raise AuthConfigError(f"cannot read API key file {key_file}: {exc.strerror}") from exc
    short = [k for k in keys if len(k) < MIN_KEY_CHARS]
    if short:
        raise AuthConfigError(f"{len(short)} API key(s) shorter than {MIN_KEY_CHARS} characters")
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiKeys:
    """The accepted keys (digests); ``None`` from :meth:`configure` means authentication is off."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = frozenset(digest(k) for k in keys)

    def __len__(self) -> int:
        return len(self._digests)

    def check(self, authorization: str | None) -> str | None:
        """None when the header carries an accepted key, else what is wrong (for the 401)."""
        if not authorization:
            return "missing API key: send Authorization: Bearer <key>"
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return "the Authorization header must be: Bearer <key>"
        if digest(key.strip()) not in self._digests:
            return "invalid API key"
        return None

    @staticmethod
    def tenant(authorization: str | None) -> str:
        """The tag of the key an authorised request came with — the first 16 hex digits of its
        SHA-256 (``printf %s "$KEY" | sha256sum | cut -c1-16``), never the key — which the gateway
        passes to the routers as the request's tenant (``Bear-Tenant``): each key has its fair
        share there, ``gateway/<tag>`` (docs/router.md, 'Fair shares'). "" without a key."""
        _, _, key = (authorization or "").partition(" ")
        return digest(key.strip()).hex()[:16] if key.strip() else ""

    @classmethod
    def configure(cls, key_file: Path | None, no_auth: bool, host: str,
                  env: dict[str, str] | None = None) -> ApiKeys | None:
        """The keys to enforce, or None with ``no_auth`` (loopback only). No key and no
        ``no_auth`` is a configuration error: a gateway never starts open by accident."""
        keys = load_keys(key_file, env)
        if no_auth:
            if keys:
                raise AuthConfigError("--no-auth given together with API keys: choose one")
            if not is_loopback(host):
                raise AuthConfigError(f"--no-auth is for local use: listen on a loopback address, not {host}")
            return None
        if not keys:
            raise AuthConfigError(f"no API keys: give --api-key-file or {ENV_KEYS}, or --no-auth on loopback")
        return cls(keys)


def write_new_key(path: Path) -> str:
    """A fresh random key written to ``path`` (mode 0600), or the first key already there."""
    if path.exists():
        existing = parse_keys(path.read_text())
        if existing:
            return existing[0]
    key = "bear-" + secrets.token_urlsafe(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key
