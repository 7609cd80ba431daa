"""The Prometheus ``/metrics`` endpoint of a BEAR process: loopback unless told otherwise
(``--metrics-host``), and a port already in use is one clear error naming the option."""

from __future__ import annotations

import errno
import socket
from typing import Any

LOOPBACK = "127.0.0.1"


def port_in_use_error(port: int, what: str, host: str = LOOPBACK) -> OSError:
    return OSError(errno.EADDRINUSE, f"port {port} ({what}) on {host} is already in use: pass another port "
                                     "or 0 to turn it off")


def port_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether ``port`` can be bound on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def start_metrics_server(port: int | None, host: str = LOOPBACK, registry: Any = None,
                         what: str = "--metrics-port") -> None:
    """Serve ``registry`` (default: prometheus_client's) on ``host:port`` from a daemon thread;
    ``port`` 0 or None: off. A port in use is one clear ``OSError`` naming the option."""
    if not port:
        return
    from prometheus_client import REGISTRY, start_http_server

    try:
        start_http_server(port, addr=host, registry=registry if registry is not None else REGISTRY)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise port_in_use_error(port, what, host) from exc
        raise
