"""The Prometheus ``/metrics`` endpoint of a BEAR process: one way for every service, on loopback
unless told otherwise."""

from __future__ import annotations

import errno
from typing import Any


def start_metrics_server(port: int | None, host: str = "127.0.0.1", registry: Any = None) -> None:
    """Serve ``/metrics`` on ``host:port`` in a background thread (nothing when ``port`` is 0 or
    None); a port in use is one clear ``OSError``."""
    if not port:
        return
    from prometheus_client import REGISTRY, start_http_server

    try:
        start_http_server(port, addr=host, registry=registry if registry is not None else REGISTRY)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise OSError(exc.errno, f"metrics port {host}:{port} is already in use: choose another "
                                     "--metrics-port, or 0 to serve none") from exc
        raise
