"""A full disk (issue 40, item 2): routing goes on when the outcome log or a KV write fails —
degraded, counted, one line, not a traceback — and comes back when writes succeed again; the
stack reports the condition and restarts its nats-server once space is back (a JetStream stream
that failed a write on a full disk stays failed until its server restarts)."""

from __future__ import annotations

import errno
import json
import time
from pathlib import Path
from types import SimpleNamespace

import nats
import pytest
from structlog.testing import capture_logs

from bear.client.submit import submit
from bear.protocol.subjects import Subjects
from bear.router.outcomes import OutcomeLog, metrics
from bear.router.registry import InstanceInfo, Registry
from bear.router.service import RouterConfig, RouterService

from fake_engine import FakeEngine, register
from waiting import wait_until


class Disk:
    """A writer that fails with ENOSPC while ``full`` (what a file on a full disk does)."""

    def __init__(self) -> None:
        self.full = False
        self.lines: list[bytes] = []

    def write(self, b: bytes) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.lines.append(b)
        return len(b)


def _count(c) -> float:  # type: ignore[no-untyped-def]
    return c._value.get()


def test_outcome_log_failing_is_counted_logged_once_and_recovers() -> None:
    disk = Disk()
    out = OutcomeLog(None, writer=disk.write)
    m = metrics()
    before = _count(m.outcome_log_errors)
    out.record({"query_id": "a", "status": "done"})
    disk.full = True
    with capture_logs() as logs:
        for k in range(50):
            out.record({"query_id": f"f{k}", "status": "done"})  # never raises
    assert _count(m.outcome_log_errors) - before == 50 and out.dropped == 50 and out.failing
    assert m.degraded.labels(part="outcome_log")._value.get() == 1
    assert [r["event"] for r in logs] == ["outcome log not writable; routing goes on, records are dropped and "
                                          "counted (bear_router_outcome_log_errors_total)"]
    disk.full = False
    with capture_logs() as logs:
        out.record({"query_id": "b", "status": "done"})
        out.record({"query_id": "c", "status": "done"})
    assert not out.failing and m.degraded.labels(part="outcome_log")._value.get() == 0
    assert [(r["event"], r["dropped"]) for r in logs] == [("outcome log writable again", 50)]
    assert [json.loads(b)["query_id"] for b in disk.lines] == ["a", "b", "c"]


def test_a_short_write_leaves_no_partial_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    out = OutcomeLog(path)
    out.record({"query_id": "whole", "status": "done"})
    real = out.writer
    assert real is not None

    def short(b: bytes) -> int:
        return real(b[: len(b) // 2])  # the disk filled within the line

    out.writer = short
    out.record({"query_id": "cut", "status": "done"})
    out.writer = real
    out.record({"query_id": "after", "status": "done"})
    out.close()
    assert [json.loads(line)["query_id"] for line in path.read_text().splitlines()] == ["whole", "after"]


class FailingKV:
    async def create(self, key: str, value: bytes) -> int:
        raise OSError(errno.ENOSPC, "JetStream: insufficient storage")


async def test_routing_goes_on_while_the_outcome_log_and_the_dedup_bucket_fail(nats_server, tmp_path) -> None:
    nc = await nats.connect(nats_server.url)
    engine = await FakeEngine(tokens=1).start()
    await register(nc, "e", "m/e", engine.port, backend="vllm")
    router = RouterService(nc, RouterConfig(predict_budget_s=0.05, predict_try_s=0.025, estimate_budget_s=0.05,
                                            estimate_try_s=0.025, outcome_log=tmp_path / "out.jsonl"))
    await router.start()
    m = metrics()
    try:
        await wait_until(lambda: [i.id for i in router.registry.healthy()] == ["e"], what="registered")
        disk = Disk()
        disk.full = True
        router.outcomes.writer = disk.write
        await router.dedup._bucket()
        real_kv, router.dedup._kv = router.dedup._kv, FailingKV()
        fell_back = _count(m.dedup_fallback)
        with capture_logs() as logs:
            for k in range(5):
                msgs = [x async for x in submit(nc, "hi", ttft_target_s=1.0, max_tokens=1, query_id=f"full-{k}")]
                assert msgs[-1]["v"] == "bear.done/1", msgs[-1]
                if k == 0:
                    assert router.dedup.failing
                    router.dedup._kv = FailingKV()  # each failure drops the bucket handle: fail again
                elif k < 4:
                    router.dedup._kv = FailingKV()
        assert router.outcomes.dropped == 5 and _count(m.dedup_fallback) - fell_back == 5
        assert m.degraded.labels(part="dedup")._value.get() == 1
        events = [r["event"] for r in logs if r.get("log_level") in ("warning", "error", "critical")]
        assert sorted(events) == sorted(["outcome log not writable; routing goes on, records are dropped and "
                                         "counted (bear_router_outcome_log_errors_total)",
                                         "dedup claims failing (JetStream not answering or not writing the bucket); "
                                         "routing goes on with this router's memory of recent ids"])
        assert not any("exc_info" in r or "exception" in r for r in logs)  # no traceback
        # writes succeed again: both recover by themselves
        disk.full = False
        router.dedup._kv = real_kv
        msgs = [x async for x in submit(nc, "hi", ttft_target_s=1.0, max_tokens=1, query_id="back")]
        assert msgs[-1]["v"] == "bear.done/1"
        assert not router.dedup.failing and not router.outcomes.failing
        assert m.degraded.labels(part="dedup")._value.get() == 0
        assert [json.loads(b)["query_id"] for b in disk.lines] == ["back"]
    finally:
        await router.stop()
        await engine.stop()
        await nc.close()


def test_stale_heartbeats_while_jetstream_does_not_write_are_not_the_instances_dying() -> None:
    nc = SimpleNamespace(stats={"reconnects": 0}, is_connected=True)
    reg = Registry(nc, Subjects(), down_after_s=10.0)
    old = time.time() - 60.0  # every heartbeat stopped a minute ago, together
    for k in range(2):
        reg.instances[f"i{k}"] = InstanceInfo(f"i{k}", base_url="http://x/v1", status="up", heartbeat=old + k)
    reg._reconnected_at = -1e9
    assert reg.healthy() == []
    failing = [True]
    reg.store_failing = lambda: failing[0]
    assert [i.id for i in reg.healthy()] == ["i0", "i1"]  # judged against the newest heartbeat
    failing[0] = False
    assert reg.healthy() == []


class FakeNats:
    def __init__(self) -> None:
        self.restarts = 0
        self.proc = SimpleNamespace(poll=lambda: None)
        self.store_dir = "/nonexistent"

    def restart(self) -> None:
        self.restarts += 1


def test_the_stack_reports_a_full_disk_and_restarts_nats_when_space_is_back(tmp_path, monkeypatch) -> None:
    from bear.stack.stack import Stack, StackConfig

    stack = Stack(StackConfig(workdir=tmp_path, disk_low_mib=64))
    stack.nats = FakeNats()  # type: ignore[assignment]
    free = [1 << 40]
    monkeypatch.setattr(stack, "free_bytes", lambda: (free[0], tmp_path))
    assert stack.check_disk() == []
    free[0] = 1 << 20
    lines = stack.check_disk()
    assert len(lines) == 1 and lines[0].startswith("disk full: 1 MiB free")
    assert stack.check_disk() == []  # once, then a reminder every 30 s
    stack._disk_told -= 31
    assert stack.check_disk() == [f"disk still full: 1 MiB free under {tmp_path}"]
    free[0] = 100 << 20  # above the threshold, not yet twice it: still full
    assert stack.check_disk() == [] and stack.disk_low
    free[0] = 1 << 30
    lines = stack.check_disk()
    assert lines[0].startswith("disk space back: 1024 MiB free") and "nats-server restarted" in lines[1]
    assert stack.nats.restarts == 1 and not stack.disk_low  # type: ignore[union-attr]
    assert stack.check_disk() == []


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_a_log_line_that_cannot_be_written_is_dropped_not_raised(fmt: str, monkeypatch) -> None:
    import io
    import logging
    import sys

    import structlog

    from bear.runtime import logging as bear_logging

    class Full(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "stderr", Full())
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        bear_logging.configure_logging(fmt, "info")
        before = bear_logging.DROPPED[0]
        structlog.get_logger("t").warning("a warning on a full disk", n=1)
        logging.getLogger("t").warning("and a stdlib one")
        assert bear_logging.DROPPED[0] - before == 2
    finally:
        root.handlers[:] = saved
        structlog.reset_defaults()
