"""Loopback ports for the servers a command starts (NATS, sim engines, vLLM, the gateway).

A port picked now and listened on later can be taken in between. Asking the kernel for a free one
(``bind(0)``) hands out a port from the ephemeral range — the range it also draws from for the
local end of every outgoing connection, and a stack's children open many (to NATS, to each other)
before the last server binds. A clean-clone CI run lost `bear up` to exactly that (a sim engine:
"address already in use"). So ports are drawn below the ephemeral range, which outgoing
connections never use, checked free when drawn, and never handed out twice by one process."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # well above the registered services most hosts run
_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default elsewhere)."""
    try:
        lo, hi = (int(x) for x in _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port no one listens on now and that no outgoing connection will take."""
    lo, _ = ephemeral_range()
    if lo - _LOWEST >= 1000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(_LOWEST, lo)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    # a host whose ephemeral range starts low: what the kernel gives
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port
