"""The KV watch every router and worker depends on survives what one entry or the broker does:
a handler that raises (e.g. an entry nested 1,000 deep) is skipped and counted, a failed watch
leaves no consumer behind, and after a NATS restart a fresh watch brings the view up to date."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats
import pytest

from bear.protocol.codec import pack
from bear.protocol.errors import BearError
from bear.protocol.messages import InstanceRecord, decode
from bear.runtime.kv import WatchStats, ensure_kv, watch_kv
from bear.runtime.nats_server import LocalNatsServer

from waiting import wait_until


def deep(n: int) -> bytes:
    """msgpack of a map nested ``n`` deep, built without recursion."""
    return b"\x81\xa1x" * n + b"\xc0"


async def test_bad_entries_are_skipped_and_counted(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    seen: dict[str, InstanceRecord] = {}

    def handler(key: str, value: bytes | None) -> None:
        if value is not None:
            seen[key] = decode(InstanceRecord, value)  # raises BearError on anything bad

    stats = WatchStats()
    task = asyncio.create_task(watch_kv(nc.jetstream(), "w_test", handler, nc=nc, stats=stats, poll_s=0.1))
    try:
        kv = await ensure_kv(nc.jetstream(), "w_test")
        await kv.put("deep", deep(1000))
        await kv.put("garbage", b"\xc1\xc1")
        await kv.put("wrong", pack({"v": "bear.instance/1", "id": "", "heartbeat": "soon"}))
        await kv.put("good", msgspec.msgpack.encode(InstanceRecord(id="good", model="m")))
        await wait_until(lambda: "good" in seen, what="the good entry")
        assert stats.rejected == 3 and stats.rewatches == 0
        with pytest.raises(BearError):
            decode(InstanceRecord, deep(1000))
        # one JetStream consumer for the watch: rejected entries do not restart it
        info = await nc.jetstream().stream_info("KV_w_test")
        assert info.state.consumer_count == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()


@pytest.mark.slow
async def test_watch_resumes_after_a_nats_restart(tmp_path) -> None:
    """The server restarts with its JetStream store: after the reconnect the watch is fresh
    (rewatched) and updates flow again; no consumer is left over from before."""
    srv = LocalNatsServer(store_dir=str(tmp_path / "js")).start()
    nc = await nats.connect(srv.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    got: dict[str, bytes] = {}
    stats = WatchStats()
    task = asyncio.create_task(watch_kv(nc.jetstream(), "w_restart", lambda k, v: got.__setitem__(k, v),
                                        nc=nc, stats=stats, poll_s=0.1, retry_s=0.2))
    try:
        kv = await ensure_kv(nc.jetstream(), "w_restart")
        await kv.put("a", b"1")
        await wait_until(lambda: got.get("a") == b"1", what="the first value")
        srv.restart()  # same port, same store
        await wait_until(lambda: nc.is_connected and nc.stats["reconnects"] >= 1, what="the reconnect")
        back = time.monotonic()
        kv = await ensure_kv(nc.jetstream(), "w_restart")
        await kv.put("a", b"2")
        await wait_until(lambda: got.get("a") == b"2", what="the update after the restart")
        print(f"update seen {time.monotonic() - back:.2f} s after the reconnect")  # with -s
        assert stats.rewatches >= 1
        info = await nc.jetstream().stream_info("KV_w_restart")
        assert info.state.consumer_count == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()
        srv.stop()
