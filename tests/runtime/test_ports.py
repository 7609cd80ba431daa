"""``bear.runtime.ports``: ports for servers are drawn below the kernel's ephemeral range (which
outgoing connections draw their local ports from), free when drawn, never twice in one process."""

from __future__ import annotations

import socket

from bear.runtime import ports


def test_ports_are_free_outside_the_ephemeral_range_and_never_repeated() -> None:
    lo, hi = ports.ephemeral_range()
    assert 1024 <= lo <= hi <= 65535
    drawn = [ports.free_port() for _ in range(200)]
    assert len(set(drawn)) == len(drawn)
    if lo - 10_000 >= 1000:
        assert all(10_000 <= p < lo for p in drawn)
    for p in drawn[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: a server can listen on it


def test_a_port_someone_listens_on_is_never_drawn(monkeypatch) -> None:
    lo, _ = ports.ephemeral_range()
    real_draw = ports.random.SystemRandom.randrange
    draws: list[int] = []
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        busy.listen()

        def draw(self, a: int, b: int) -> int:
            # the first draw offers the taken port; later ones are real draws (any fixed second
            # offer can itself be taken by one of the host's connections: a CI run saw that)
            draws.append(taken if not draws else real_draw(self, a, b))
            return draws[-1]

        monkeypatch.setattr(ports.random.SystemRandom, "randrange", draw)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (max(lo, 60_000), 65_000))
        monkeypatch.setattr(ports, "_LOWEST", 1024)
        got = ports.free_port()
    assert draws[0] == taken and len(draws) >= 2
    assert got != taken


def test_a_low_ephemeral_range_falls_back_to_the_kernel(monkeypatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (10_500, 60_999))
    p = ports.free_port()
    assert 0 < p < 65536
