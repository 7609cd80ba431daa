"""The whole BEAR stack as child processes (``bear up``, ``bear bench router`` and the end-to-end
tests): a local nats-server (unless a URL is given), the instances — sim engines with the paper's
profiles, or real vLLM processes with the BEAR scheduler plugin and one ``bear snapshotter`` each
(``backend="vllm"``) — a trained predictor, estimator workers, the calibrator, routers and, with ``gateway_port``,
the OpenAI-compatible gateway in front of them.

Every start gets a run directory of its own, ``<workdir>/runs/<time>-<pid>-<id>/`` (``<workdir>/latest``
points to the newest; the last ``runs_kept`` are kept): the children's logs ``logs/<name>.log``, the
routers' outcome logs and the local nats-server's JetStream store (removed on stop). Children run in
sessions of their own and die with this process even when it is SIGKILLed (bear.runtime.children);
``stop()`` sends SIGTERM in reverse start order (routers first, so queries in flight are drained
while their dependencies still run) and SIGKILLs what does not exit within the grace period. A child
that exits during start-up fails ``start()`` with ``StackError`` naming it and quoting its error;
once up, ``supervise()`` restarts a child that died, with exponential backoff (docs/security.md).

Security is on unless ``insecure``: the local nats-server runs with a configuration generated for
this run (bear.runtime.nats_auth: one nkey identity per service and per instance, in
``<run>/auth/``, files 0600), ``admin`` (this process) creates the KV buckets, every child
connects as its own identity (``$BEAR_NATS_CREDS``), and every engine requires an API key that
only the routers hold (``<run>/auth/engine-keys.json``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bear.protocol.messages import Calibration, encode
from bear.protocol.subjects import Subjects
from bear.runtime import aio
from bear.runtime.children import spawn
from bear.runtime.identity import CREDS_ENV
from bear.runtime.metrics import LOOPBACK, port_free, port_in_use_error
from bear.runtime.nats_auth import REPLICATED, AuthFiles, generate, instance_identity_name, replica_names
from bear.runtime.nats_server import LocalNatsCluster, LocalNatsServer, free_port

# the tiny model's engine: small batches, and tool calls served (a named tool_choice needs a
# parser in vLLM 0.32; ``pythonic`` needs no special tokens, which the tiny tokenizer lacks)
VLLM_TINY_ARGS = ("--max-model-len", "2048", "--max-num-batched-tokens", "256", "--max-num-seqs", "8",
                  "--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
DRAIN_S = 10.0  # bear up's stop: the gateway's and routers' answers in flight relayed this long at most
STOP_GRACE_S = 5.0  # … then every other child this long before it is killed
PAPER_POOL = ("qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100-tp2")
INSTANCE_NAMES = {"qwen3-0.6b-h100": "qwen0-6b-0", "qwen3-8b-h100": "qwen8b-0", "qwen3-32b-2xh100-tp2": "qwen32b-0"}
_RUN_NAME = re.compile(r"^\d{8}-\d{6}-(\d+)-[0-9a-f]{4}$")


class StackError(ChildProcessError):
    """A child of the stack failed: the message names it and quotes its error."""


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of the stack's environment
    group: bool = False  # signal the whole process group (vLLM: API server, engine core, workers)
    identity: str = ""  # the NATS identity it connects as ("": none, it does not use NATS)
    started_at: float = 0.0  # monotonic
    restarts: int = 0  # restarts since it last ran long enough to count as healthy
    restart_at: float | None = None  # a restart is due then (monotonic)

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as logf:
            self.proc = spawn(self.argv, stdout=logf, stderr=subprocess.STDOUT, env={**env, **self.env})
        self.started_at = time.monotonic()
        self.restart_at = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            if self.group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)

    def last_error(self) -> str:
        """The child's own account of why it stopped, from the end of its log: the one-line
        ``error: …`` every ``bear`` command ends with, else the last error record or traceback line."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
                lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        for ln in reversed(lines):
            if ln.startswith("error: "):
                return ln[len("error: "):]
        for ln in reversed(lines):
            if ln.startswith("{"):
                with contextlib.suppress(ValueError):
                    rec = json.loads(ln)
                    if isinstance(rec, dict) and rec.get("level") in ("error", "critical"):
                        return " ".join(str(rec[k]) for k in ("event", "error") if rec.get(k))
            elif re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", ln):
                return ln
        return lines[-1] if lines else ""

    def failure(self) -> str:
        """``<name> exited … : <its error> (log <path>)``."""
        rc = self.proc.poll() if self.proc is not None else None
        how = f"exited with code {rc}" if rc is not None and rc >= 0 else (
            f"was killed by signal {-rc}" if rc is not None else "did not start")
        why = self.last_error()
        return f"{self.name} {how}{': ' + why if why else ''} (log {self.log_path})"


@dataclass
class StackConfig:
    workdir: Path
    nats_url: str | None = None
    profiles: tuple[str, ...] = PAPER_POOL
    estimator_workers: int = 1
    snapshot_max_age_s: float = 1.0  # the estimators' --max-age: older snapshots use the analytic fallback
    predictors: int = 1  # predictor processes (one queue group); several: one identity each (predictor-<k>)
    routers: int = 1
    policy: str = "bear"
    router_args: list[str] = field(default_factory=list)
    sim_args: list[str] = field(default_factory=list)  # extra `bear sim-engine` arguments (e.g. --tokenizer DIR)
    predictor_dir: Path | None = None
    n_train: int = 3000
    train_seed: int = 10_000
    calibrator: bool = True
    metrics_port: int = 0  # router i serves /metrics on metrics_port + i; 0: off
    metrics_host: str = LOOPBACK
    runs_kept: int = 5  # run directories kept under <workdir>/runs (this one included)
    log_level: str = "info"
    prefix: str = "bear"
    seed: int = 0
    backend: str = "sim"  # sim | vllm
    vllm_python: str | None = None  # None: BEAR_VLLM_PYTHON, else ~/.cache/bear/vllm-venv/bin/python
    vllm_model: Path | None = None  # None: the tiny random Qwen3 (CPU), written to <workdir>/tiny-qwen3
    vllm_instances: int = 2
    vllm_args: list[str] | None = None  # extra vLLM arguments; None: VLLM_TINY_ARGS for the tiny model, else none
    vllm_kv_gib: str = "1"  # VLLM_CPU_KVCACHE_SPACE (CPU build only)
    vllm_price_in: float = 0.1  # USD / million tokens of instance 0; instance k: × (k + 1)
    vllm_price_out: float = 0.2
    vllm_start_timeout_s: float = 900.0  # first start compiles (~2 min on 2 CPU cores)
    gateway_port: int = 0  # the OpenAI-compatible gateway on this port; 0: none
    gateway_key_file: Path | None = None  # its API keys; None: --no-auth (it listens on loopback)
    insecure: bool = False  # no NATS authentication, no engine API keys (experiments only)
    auth_dir: Path | None = None  # with nats_url: identities from `bear nats config` (else anonymous)
    clients: tuple[str, ...] = ()  # client identities besides `client` and `gateway`: one per user or application
    nats_cluster: int = 1  # nodes of the local NATS; > 1: a cluster on loopback, KV buckets replicated
    restart_backoff_s: tuple[float, float] = (1.0, 30.0)  # first and longest wait before a restart
    healthy_after_s: float = 60.0  # a child that ran this long starts its backoff afresh
    disk_low_mib: int = 64  # less free space than this under the run directory is reported (0: not checked)


class Stack:
    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.nats: LocalNatsServer | None = None
        self.cluster: LocalNatsCluster | None = None  # nats_cluster > 1
        self.children: dict[str, Child] = {}
        self.instances: dict[str, int] = {}  # instance id → HTTP port
        self.sim_profiles: dict[str, str] = {}  # sim instance id → its profile (profiled before serving)
        self.shms: list[str] = []  # vLLM plugin rings in /dev/shm, removed by stop()
        self.served_model = ""
        self.tiny = False  # vLLM backend serving the tiny random model
        self.url = cfg.nats_url or ""
        self.auth: AuthFiles | None = None  # the NATS identities (None: insecure or anonymous)
        self.engine_keys: dict[str, str] = {}  # instance → the API key its engine requires
        self.bindings: list[Any] = []  # what each instance is provisioned with (bear.protocol.provisioned)
        self.sweeper: Any = None  # bear.tokenizer.store.ChunkSweeper: orphan tokenizer chunks purged as admin
        self.disk_low = False  # the run directory's disk is (nearly) full: reported, then acted on when freed
        self._disk_told = 0.0  # monotonic time of the last line about it
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = cfg.workdir / "runs" / f"{stamp}-{os.getpid()}-{uuid.uuid4().hex[:4]}"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    def _bear(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "bear", *args]

    def _child(self, name: str, argv: list[str], identity: str = "") -> Child:
        c = Child(name, argv, self.log_dir / f"{name}.log", identity=identity)
        self.children[name] = c
        return c

    @property
    def auth_path(self) -> Path:
        return self.run_dir / "auth"

    def creds(self, identity: str = "admin") -> Path | None:
        """The file of one NATS identity (None when the stack runs without authentication)."""
        return self.auth.creds.get(identity) if self.auth is not None else None

    def nats_options(self, identity: str = "admin") -> dict[str, Any]:
        """``nats.connect`` options that authenticate as ``identity`` (tests, benchmarks)."""
        from bear.runtime.service import auth_options

        path = self.creds(identity)
        return auth_options(path) if path is not None else {}

    def run_load(self, queries: Any, times: Any, max_tokens: int = 1) -> Any:
        """Submit ``queries`` at ``times`` as the ``client`` identity and wait for every answer
        (``bear.load.generator.run_load``'s result): what the benchmarks drive the stack with."""
        import nats

        from bear.load.generator import run_load

        async def go() -> Any:
            nc = await nats.connect(self.url, **self.nats_options("client"))
            try:
                return await run_load(nc, queries, times, max_tokens=max_tokens)
            finally:
                await nc.close()

        return aio.run(go())

    def outcome_log(self, i: int = 0) -> Path:
        return self.run_dir / f"outcomes-router-{i}.jsonl"

    def metrics_ports(self) -> list[int]:
        return [self.cfg.metrics_port + i for i in range(self.cfg.routers)] if self.cfg.metrics_port else []

    def describe(self) -> dict[str, Any]:
        """Where everything is (what ``bear up`` publishes for the other commands)."""
        pids = {n: c.proc.pid for n, c in self.children.items() if c.proc is not None}
        if self.nats is not None and self.nats.proc is not None:
            pids["nats-server"] = self.nats.proc.pid
        host = self.cfg.metrics_host if self.cfg.metrics_host != "0.0.0.0" else LOOPBACK
        client = self.creds("client")
        return {"nats_url": self.url, "prefix": self.cfg.prefix, "backend": self.cfg.backend,
                "auth": "nkeys" if self.auth is not None else "none",
                "client_creds": str(client.resolve()) if client is not None else None,
                "instances": {i: f"http://127.0.0.1:{p}/v1" for i, p in self.instances.items()},
                "load_context": self.load_context(),
                "metrics": [f"http://{host}:{p}/metrics" for p in self.metrics_ports()],
                "run_dir": str(self.run_dir.resolve()), "logs": str(self.log_dir.resolve()),
                "outcome_logs": [str(self.outcome_log(i).resolve()) for i in range(self.cfg.routers)],
                "pids": pids}

    def load_context(self) -> int | None:
        """The context in tokens a load through this stack fits its prompts into (``bear load
        --context``): vLLM's ``--max-model-len``, which every instance here runs with. None for sim
        engines — their 40,960-token context holds the synthetic mix's longest prompt with 4,096
        output tokens — and for vLLM left at the model's own default (unknown here)."""
        return _option_int(self._vllm_args(), "--max-model-len") if self.cfg.backend == "vllm" else None

    def _vllm_args(self) -> list[str]:
        """The vLLM arguments of every instance (the tiny model's defaults unless given)."""
        if self.cfg.vllm_args is not None:
            return list(self.cfg.vllm_args)
        return list(VLLM_TINY_ARGS) if self.tiny else []

    def plan(self) -> None:
        cfg = self.cfg
        common = ["--nats", self.url, "--log-format", "json", "--log-level", cfg.log_level]
        if cfg.backend == "vllm":
            self._plan_vllm(common)
        for k, prof in enumerate(cfg.profiles if cfg.backend == "sim" else ()):
            inst = INSTANCE_NAMES.get(prof, f"inst-{k}")
            if inst in self.instances:
                inst = f"{inst}-{k}"
            port = free_port()
            self.instances[inst] = port
            self.sim_profiles[inst] = prof
            key = self._engine_key(inst)
            self._bind_sim(inst, prof, port)
            self._child(f"sim-{inst}", self._bear("sim-engine", "--profile", prof, "--port", str(port),
                                                  "--instance", inst, "--nats", self.url, "--seed",
                                                  str(cfg.seed * 100 + k), *key, *cfg.sim_args),
                    instance_identity_name(inst))
        assert cfg.predictor_dir is not None
        # one identity per replica where there are several (bear.runtime.nats_auth.replica_names): a
        # leaked one is revoked alone, and each says which it is in its replies (issue 40)
        predictors = replica_names("predictor", cfg.predictors)
        for name in predictors:
            self._child(name, self._bear("predictor", *common, "--model-dir", str(cfg.predictor_dir)), name)
        estimators = replica_names("estimator", cfg.estimator_workers)
        for i in range(cfg.estimator_workers):
            argv = self._bear("estimator", *common, "--workers", "1", "--max-age", f"{cfg.snapshot_max_age_s:g}")
            self._child(f"estimator-{i}", argv, estimators[i])
        if cfg.calibrator:
            self._child("calibrator", self._bear("calibrator", "--nats", self.url, "--log-format", "json",
                                                 "--log-level", cfg.log_level), "calibrator")
        keys = ["--engine-keys", str(self._write_engine_keys())] if self.engine_keys else []
        if self.secured:  # only what this stack started: its instances' bindings and base URLs (issue 26)
            keys += ["--provisioning", *(a for i in self.instances for a in ("--allow-base-url", self._base_url(i)))]
        for i in range(cfg.routers):
            argv = self._bear("router", *common, "--policy", cfg.policy, "--outcome-log", str(self.outcome_log(i)),
                              *keys, *cfg.router_args)
            if cfg.metrics_port:
                argv += ["--metrics-port", str(cfg.metrics_port + i), "--metrics-host", cfg.metrics_host]
            self._child(f"router-{i}", argv, "router")
        if cfg.gateway_port:  # last: it is stopped first, while the routers still answer
            auth = ["--api-key-file", str(cfg.gateway_key_file)] if cfg.gateway_key_file else ["--no-auth"]
            self._child("gateway", self._bear("gateway", *common, "--port", str(cfg.gateway_port), *auth), "gateway")

    @property
    def secured(self) -> bool:
        """The stack runs with NATS identities (its own server's, or ``auth_dir``'s), so ``admin``
        provisions the instances and the routers take only what was provisioned."""
        return not self.cfg.insecure and (not self.cfg.nats_url or self.cfg.auth_dir is not None)

    def _base_url(self, instance: str) -> str:
        return f"http://127.0.0.1:{self.instances[instance]}/v1"

    def _bind_sim(self, instance: str, profile_name: str, port: int) -> None:
        """A sim instance's binding: what ``bear sim-engine --profile`` registers."""
        from bear.protocol.provisioned import provisioned
        from bear.sim.profile import load_profile

        prof = load_profile(profile_name)
        self.bindings.append(provisioned(
            instance, prof.model, f"http://127.0.0.1:{port}/v1", prof.prices.get("input_per_mtok", 0.0),
            prof.prices.get("output_per_mtok", 0.0), max_model_len=int(prof.engine_config()["max_model_len"])))

    def _engine_key(self, instance: str) -> list[str]:
        """A fresh API key for one engine (none with ``insecure``): the engine's option naming its
        key file; the routers get every key (``_write_engine_keys``)."""
        if self.cfg.insecure:
            return []
        key = self.engine_keys[instance] = "bear-engine-" + secrets.token_urlsafe(24)
        return ["--api-key-file", str(_private_file(self.auth_path / f"engine-{instance}.key", key + "\n"))]

    def _write_engine_keys(self) -> Path:
        return _private_file(self.auth_path / "engine-keys.json", json.dumps(self.engine_keys, indent=2))

    @property
    def gateway_url(self) -> str:
        """The gateway's OpenAI base URL ("" without a gateway)."""
        return f"http://127.0.0.1:{self.cfg.gateway_port}/v1" if self.cfg.gateway_port else ""

    def _plan_vllm(self, common: list[str]) -> None:
        """Per instance: vLLM (plugin ring ``shm``) and the snapshotter that registers it."""
        from bear.vllm_instance.launch import vllm_command, vllm_env_overrides

        cfg = self.cfg
        assert cfg.vllm_python is not None and cfg.vllm_model is not None
        args = self._vllm_args()
        self.served_model = "tiny" if self.tiny else cfg.vllm_model.name
        for k in range(cfg.vllm_instances):
            inst, port, shm = f"vllm-{k}", free_port(), f"bear-vllm-{k}-{uuid.uuid4().hex[:8]}"
            self.instances[inst] = port
            self.shms.append(shm)
            c = self._child(inst, vllm_command(cfg.vllm_python, cfg.vllm_model, port, self.served_model, args,
                                               kv_events=shm))
            c.env, c.group = vllm_env_overrides(shm, cfg.vllm_kv_gib), True
            if not cfg.insecure:  # vLLM reads its --api-key from VLLM_API_KEY (kept off the command line)
                self._engine_key(inst)
                c.env["VLLM_API_KEY"] = self.engine_keys[inst]
            self._child(f"snapshotter-{inst}", self._bear(
                "snapshotter", "--instance", inst, "--shm", shm, *common, "--model", self.served_model,
                "--base-url", f"http://127.0.0.1:{port}/v1", "--price-input", str(cfg.vllm_price_in * (k + 1)),
                "--price-output", str(cfg.vllm_price_out * (k + 1))), instance_identity_name(inst))  # fmt: skip
            from bear.protocol.provisioned import provisioned

            self.bindings.append(provisioned(inst, self.served_model, f"http://127.0.0.1:{port}/v1",
                                             cfg.vllm_price_in * (k + 1), cfg.vllm_price_out * (k + 1)))

    def _prepare_vllm(self) -> None:
        from bear.vllm_instance.launch import default_vllm_python, make_tiny_model

        cfg = self.cfg
        cfg.vllm_python = cfg.vllm_python or default_vllm_python()
        self.tiny = cfg.vllm_model is None
        if cfg.vllm_model is None:
            cfg.vllm_model = make_tiny_model(cfg.vllm_python, cfg.workdir / "tiny-qwen3")

    def _wait_vllm_healthy(self) -> None:
        from bear.vllm_instance.launch import healthy

        end = time.monotonic() + self.cfg.vllm_start_timeout_s
        todo = dict(self.instances)
        while todo:
            self.raise_if_dead()
            if time.monotonic() > end:
                raise TimeoutError(f"vLLM not healthy after {self.cfg.vllm_start_timeout_s:.0f} s: {sorted(todo)}")
            todo = {i: p for i, p in todo.items() if not healthy(p)}
            time.sleep(0.5)

    def start(self, timeout_s: float = 120.0) -> None:
        cfg = self.cfg
        if cfg.backend not in ("sim", "vllm"):
            raise ValueError(f"unknown backend {cfg.backend!r} (sim or vllm)")
        for port in self.metrics_ports():  # before anything starts: one line, not a dead router
            if not port_free(port, cfg.metrics_host):
                raise port_in_use_error(port, "--metrics-port", cfg.metrics_host)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._link_latest()
        self._prune_runs()
        if cfg.backend == "vllm":
            self._prepare_vllm()
        if not self.url and cfg.nats_cluster > 1:
            self.cluster = LocalNatsCluster(cfg.nats_cluster, log_dir=self.log_dir)
            self.url = self.cluster.url
        elif not self.url:
            self.nats = LocalNatsServer(store_dir=str(self.run_dir / "jetstream"),
                                        log_path=self.log_dir / "nats-server.log")
            self.url = self.nats.url  # the port is chosen: the children's command lines can name it
        if cfg.predictor_dir is None:
            from bear.predictor.synth import trained_predictor_dir

            cfg.predictor_dir = trained_predictor_dir(cfg.n_train, cfg.train_seed)
        self.plan()  # names the instances, which the identities need
        self._set_up_auth()
        if self.nats is not None:
            self.nats.start()
        if self.cluster is not None:
            self._spread()
            self.cluster.start()
        if self.auth is not None or self.cluster is not None:
            aio.run(_provision(self.url, self.creds("admin"), cfg.prefix, min(3, cfg.nats_cluster),
                               bindings=self.bindings if self.secured else ()))
        if self.sim_profiles and cfg.calibrator:
            aio.run(_publish_profiled(self.url, self.creds("admin"), cfg.prefix, self.sim_profiles, cfg.seed))
        for c in self.children.values():
            c.start(self._env())
        if cfg.backend == "vllm":
            self._wait_vllm_healthy()
        aio.run(wait_ready(self.url, list(self.instances), cfg.prefix, timeout_s, self, self.gateway_url,
                           creds=self.creds("admin")))
        if self.nats is not None or self.cluster is not None or self.auth is not None:  # admin's rights are ours
            from bear.runtime.service import connect
            from bear.tokenizer.store import ChunkSweeper

            self.sweeper = ChunkSweeper(self.url, self.creds("admin"), Subjects(cfg.prefix).tokenizers_bucket,
                                         connect=connect).start()

    def _set_up_auth(self) -> None:
        """The identities: generated for the local server (unless ``insecure``), or read from
        ``auth_dir`` for a given NATS; each child's ``$BEAR_NATS_CREDS`` names its own."""
        cfg = self.cfg
        if cfg.insecure:
            return
        if self.nats is not None or self.cluster is not None:
            self.auth = generate(self.auth_path, list(self.instances), Subjects(cfg.prefix),
                                 clients=tuple(dict.fromkeys(("client", "gateway", *cfg.clients))),
                                 replicas={"predictor": cfg.predictors, "estimator": cfg.estimator_workers})
            for node in [self.nats] if self.nats is not None else self.cluster.nodes:  # type: ignore[union-attr]
                node.config = self.auth.config
        elif cfg.auth_dir is not None:
            self.auth = AuthFiles(cfg.auth_dir, cfg.auth_dir / "auth.conf",
                                  {p.stem: p for p in sorted(cfg.auth_dir.glob("*.json"))})
        if self.auth is None:
            return
        for c in self.children.values():
            if c.identity:
                path = self.auth.creds.get(c.identity)
                if path is None and (svc := c.identity.rsplit("-", 1)[0]) in REPLICATED:
                    path = self.auth.creds.get(svc)  # an auth_dir with one shared identity per service
                if path is None:
                    raise StackError(f"no NATS identity {c.identity!r} for {c.name} in {self.auth.directory}")
                c.env[CREDS_ENV] = str(path)

    def _spread(self) -> None:
        """Each child connects to one node of the cluster, round robin (it learns the others from
        the server and fails over to them)."""
        assert self.cluster is not None
        urls = [node.url for node in self.cluster.nodes]
        for k, c in enumerate(self.children.values()):
            if "--nats" in c.argv:
                c.argv[c.argv.index("--nats") + 1] = urls[k % len(urls)]

    def node_of(self, name: str) -> int | None:
        """The cluster node ``name`` was started against (None: not on a cluster)."""
        if self.cluster is None or "--nats" not in self.children[name].argv:
            return None
        url = self.children[name].argv[self.children[name].argv.index("--nats") + 1]
        return [n.url for n in self.cluster.nodes].index(url)

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop(CREDS_ENV, None)  # a child without an identity of its own connects with none
        return env

    def _link_latest(self) -> None:
        latest = self.cfg.workdir / "latest"
        tmp = self.cfg.workdir / f".latest-{os.getpid()}"
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(self.run_dir.relative_to(self.cfg.workdir))
            tmp.replace(latest)

    def _prune_runs(self) -> None:
        """Keep the newest ``runs_kept`` run directories, never one whose stack still runs; the
        JetStream store a killed stack could not remove goes too."""
        runs = sorted(p for p in (self.cfg.workdir / "runs").iterdir() if _RUN_NAME.match(p.name))
        n_old = max(0, len(runs) - max(1, self.cfg.runs_kept))
        for k, old in enumerate(runs):
            m = _RUN_NAME.match(old.name)
            pid = int(m.group(1)) if m else 0
            if old == self.run_dir or _pid_alive(pid):  # this process's other stacks included
                continue
            shutil.rmtree(old if k < n_old else old / "jetstream", ignore_errors=True)

    def raise_if_dead(self) -> None:
        """``StackError`` naming every child that exited and quoting its error."""
        dead = [c for c in self.children.values() if not c.alive()]
        if dead:
            raise StackError(f"start-up failed: {'; '.join(c.failure() for c in dead)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        c = self.children[name]
        c.signal(sig)
        if c.proc is not None:
            c.proc.wait(timeout=10)

    def restart_child(self, name: str) -> None:
        self.children[name].start(self._env())

    def supervise(self) -> list[str]:
        """Restart what died, each child with its own exponential backoff (``restart_backoff_s``;
        a child that ran ``healthy_after_s`` starts afresh) — one dead part never takes the stack
        down. Returns one line per event (a death noticed, a restart made) for the console."""
        events = self.check_disk()
        now = time.monotonic()
        first, longest = self.cfg.restart_backoff_s
        if self.nats is not None and self.nats.proc is not None and self.nats.proc.poll() is not None:
            events.append(f"nats-server exited with code {self.nats.proc.returncode}; restarting it")
            self.nats.proc = None
            self.nats.start()
        for c in self.children.values():
            if c.alive() or c.proc is None:
                continue
            if c.restart_at is None:
                if now - c.started_at >= self.cfg.healthy_after_s:
                    c.restarts = 0
                wait = min(longest, first * 2 ** c.restarts)
                c.restart_at = now + wait
                events.append(f"{c.failure()}; restarting in {wait:.0f} s")
            elif now >= c.restart_at:
                c.restarts += 1
                c.start(self._env())
                events.append(f"{c.name} restarted (restart {c.restarts})")
        return events

    def free_bytes(self) -> tuple[int, Path]:
        """The least free space (bytes available to this user) of the file systems the stack
        writes: its run directory (logs, outcome logs) and the local nats-server's JetStream store."""
        paths = [self.run_dir] + ([Path(self.nats.store_dir)] if self.nats is not None else [])
        best: tuple[int, Path] | None = None
        for p in paths:
            try:
                st = os.statvfs(p)
            except OSError:
                continue
            free = st.f_bavail * st.f_frsize
            if best is None or free < best[0]:
                best = (free, p)
        return best if best is not None else (1 << 62, self.run_dir)

    def check_disk(self) -> list[str]:
        """The disk condition as lines for the console (issue 40): one when free space falls under
        ``disk_low_mib`` (JetStream then fails writing the registry and dedup buckets, the logs
        and outcome logs lose lines), a reminder every 30 s while it lasts, and one when space is
        back (twice the threshold) — then the local nats-server is restarted, store kept: a
        JetStream stream that failed a write on a full disk stays failed until its server
        restarts (nats-server 2.15: "critical write error"), and with the registry's stream so,
        every heartbeat goes stale and every query is ``unavailable``."""
        low_b = self.cfg.disk_low_mib << 20
        if low_b <= 0:
            return []
        free, path = self.free_bytes()
        now = time.monotonic()
        mib = free >> 20
        if not self.disk_low and free < low_b:
            self.disk_low, self._disk_told = True, now
            return [f"disk full: {mib} MiB free under {path} (less than {self.cfg.disk_low_mib} MiB): JetStream "
                    "cannot write the registry and dedup buckets, logs and outcome logs lose lines; free space there "
                    "(nats-server is restarted once it is back)"]
        if self.disk_low and free < 2 * low_b:
            if now - self._disk_told >= 30.0:
                self._disk_told = now
                return [f"disk still full: {mib} MiB free under {path}"]
            return []
        if not self.disk_low:
            return []
        self.disk_low = False
        lines = [f"disk space back: {mib} MiB free under {path}"]
        if self.nats is not None and self.nats.proc is not None and self.nats.proc.poll() is None:
            self.nats.restart()
            lines.append("nats-server restarted (store kept): JetStream streams that failed writing while the disk "
                         "was full stay failed until their server restarts")
        return lines

    def stop(self, drain_s: float = DRAIN_S, grace_s: float = STOP_GRACE_S) -> None:
        """Everything down within ``drain_s + grace_s`` (and NATS's own stop): the gateway and
        the routers first, together, their answers in flight relayed for up to ``drain_s``; then
        every other child, killed if still running ``grace_s`` later. One deadline per stage, not
        one per child: each child's wait used to restart the clock, and a loaded vLLM stack took
        ≈25 s to stop (issue 41)."""
        if self.sweeper is not None:
            self.sweeper.stop()
            self.sweeper = None
        children = list(reversed(list(self.children.values())))
        front = [c for c in children if c.name.startswith("router") or c.name == "gateway"]
        for stage, wait_s in ((front, drain_s), ([c for c in children if c not in front], grace_s)):
            for c in stage:
                c.signal(signal.SIGTERM)
            deadline = time.monotonic() + wait_s
            for c in stage:
                _wait(c, max(0.0, deadline - time.monotonic()))
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
            shutil.rmtree(self.run_dir / "jetstream", ignore_errors=True)  # temporary: this run's only
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        if self.shms:
            from bear.vllm_instance.launch import remove_shm

            for shm in self.shms:
                remove_shm(shm)

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _private_file(path: Path, text: str) -> Path:
    """``text`` in a file only this user reads (0600, created that way)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


async def _provision(url: str, admin: Path | None, prefix: str, replicas: int = 1, within_s: float = 30.0,
                     bindings: Any = ()) -> None:
    """Create the KV buckets as ``admin`` (the other identities may not) and bind each instance
    to what this stack starts it with (``bindings``); a cluster's JetStream needs a few seconds to
    elect its leader first."""
    from bear.runtime.kv import bind_instances, provision
    from bear.runtime.service import connect

    nc = await connect(url, "bear-up-provision", creds=admin if admin is not None else "")
    end = time.monotonic() + within_s
    try:
        while True:
            try:
                await provision(nc.jetstream(timeout=2.0), Subjects(prefix), replicas=replicas)
                await bind_instances(nc.jetstream(timeout=2.0), Subjects(prefix), list(bindings))
                return
            except Exception:
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


def profiled_calibrations(profiles: dict[str, str], seed: int = 0) -> dict[str, Calibration]:
    """Each sim instance's calibration from a profiling run of its profile, before it serves (as
    an operator profiles an engine: bear.sim.profiling): β is then the instance's own from the
    first query on, not the nominal placeholder until the online refit has records."""
    from bear.calibrator.fit import robust_fit
    from bear.sim.profile import load_profile
    from bear.sim.profiling import profile_records

    out: dict[str, Calibration] = {}
    for k, (inst, prof) in enumerate(sorted(profiles.items())):
        cal = robust_fit(profile_records(load_profile(prof), seed=seed * 100 + k), inst)
        out[inst] = msgspec.structs.replace(cal, source="profiled")
    return out


async def _publish_profiled(url: str, admin: Path | None, prefix: str, profiles: dict[str, str], seed: int) -> None:
    """Put the sim instances' profiled calibrations into ``bear_calibration`` (as ``admin``: only the
    calibrator and admin may write it) before the estimators start watching it."""
    from bear.runtime.kv import ensure_kv
    from bear.runtime.service import connect

    cals = await asyncio.to_thread(profiled_calibrations, profiles, seed)
    nc = await connect(url, "bear-up-calibrate", creds=admin if admin is not None else "")
    try:
        kv = await ensure_kv(nc.jetstream(timeout=5.0), Subjects(prefix).calibration_bucket)
        for inst, cal in cals.items():
            await kv.put(inst, encode(cal))
    finally:
        await nc.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _wait(c: Child, grace_s: float) -> None:
    """Until ``c`` exits, killed (its process group with it) after ``grace_s``."""
    if c.proc is None:
        return
    try:
        c.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        c.signal(signal.SIGKILL)
        c.proc.wait()


async def wait_ready(url: str, instances: list[str], prefix: str, timeout_s: float, stack: Stack | None = None,
                     gateway_url: str = "", creds: Path | None = None) -> None:
    """Until every instance is registered, the predictor and an estimator answer PING, a router
    routes a probe query to the end and the gateway (if any) answers /health. ``creds``: the
    identity to ask as (``admin`` of a stack with authentication)."""
    from bear.client.submit import submit
    from bear.protocol.codec import unpack_map
    from bear.protocol.replies import Done, Reply
    from bear.protocol.subjects import Subjects
    from bear.runtime.kv import ensure_kv
    from bear.runtime.service import connect

    end = time.monotonic() + timeout_s
    nc = await connect(url, "bear-up-ready", creds=creds if creds is not None else "")
    waiting = ["every instance registered"]

    def check() -> None:
        if stack is not None:
            stack.raise_if_dead()
        if time.monotonic() > end:
            where = f" (logs in {stack.log_dir})" if stack is not None else ""
            raise TimeoutError(f"the stack did not come up within {timeout_s:.0f} s; still waiting for "
                               f"{waiting[0]}{where}")

    try:
        kv = await ensure_kv(nc.jetstream(), Subjects(prefix).instances_bucket)
        while True:
            check()
            try:
                keys = set(await kv.keys())
            except Exception:
                keys = set()
            if set(instances) <= keys:
                fresh = [unpack_map((await kv.get(k)).value).get("heartbeat", 0) for k in instances]
                if all(time.time() - h < 10 for h in fresh):
                    break
            await asyncio.sleep(0.2)
        for svc in ("bear-predictor", "bear-estimator"):
            waiting[0] = f"{svc} to answer $SRV.PING"
            while True:
                check()
                try:
                    await nc.request(f"$SRV.PING.{svc}", b"", timeout=0.5)
                    break
                except Exception:
                    await asyncio.sleep(0.2)
        waiting[0] = "a router to route a probe query"
        while True:
            check()
            last: Reply | None = None
            async for m in submit(nc, "ready?", ttft_target_s=5.0, max_tokens=1, query_id=f"probe-{time.time_ns()}",
                                  accept_timeout_s=1.0, resubmits=0, subjects=Subjects(prefix)):
                last = m
            if isinstance(last, Done):
                break
            await asyncio.sleep(0.3)
        while gateway_url:
            check()
            if await _healthy(gateway_url.removesuffix("/v1") + "/health"):
                return
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def _healthy(url: str) -> bool:
    import aiohttp

    try:
        async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


def _option_int(args: list[str], name: str) -> int | None:
    """The integer value of ``name`` in a command line (``--name N`` or ``--name=N``; the last wins)."""
    value = None
    for k, a in enumerate(args):
        raw = a.split("=", 1)[1] if a.startswith(name + "=") else args[k + 1] if a == name and k + 1 < len(args) else None
        if raw is not None:
            try:
                value = int(raw)
            except ValueError:
                value = None
    return value
