"""vLLM's KV event batches (encoded by vLLM's own classes: make_kv_golden.py) → BEAR's ops, and
the reader's seq handling against a fake vLLM publisher on ZMQ sockets: a late start replays the
history, a gap is filled from the replay socket, and what the replay buffer no longer holds is
reported lost."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from bear.prefix.hashing import external
from bear.protocol.messages import KvOp
from bear.snapshotter.kv_events import KvEventsReader, connect_endpoint, to_ops

from waiting import HANG_S, wait_until

DATA = json.loads((Path(__file__).resolve().parent / "data" / "kv_batches_vllm.json").read_text())


def test_vllm_batches_decode_to_ops() -> None:
    (t1, a), (t2, b), (t3, c) = (to_ops(bytes.fromhex(x["payload"])) for x in DATA)
    assert (t1, t2, t3) == (1.0, 2.0, 3.0)
    assert a == [KvOp("stored", [1, 2, (1 << 64) - 5]), KvOp("removed", [1])]
    assert b == [KvOp("stored", [external(bytes(range(32)))]), KvOp("cleared"), KvOp("stored", [7])]
    assert c == [KvOp("stored", [10])]  # the CPU tier and KV cache group 1 are not mirrored
    with pytest.raises(ValueError):
        to_ops(b"\x93garbage")


def test_connect_endpoint() -> None:
    assert connect_endpoint("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert connect_endpoint("ipc:///tmp/x") == "ipc:///tmp/x"


def batch(ts: float, h: int) -> bytes:
    return msgspec.msgpack.encode([ts, [{"type": "BlockStored", "block_hashes": [h], "medium": "GPU"}], 0])


class FakeVllm:
    """vLLM's ZmqEventPublisher protocol: PUB (topic, seq, payload) and a ROUTER replay socket
    that resends buffered batches from a seq, then (b"", END) — with a bounded buffer. The PUB
    side is an XPUB (the same on the wire) so that the test can wait for the reader's subscription:
    ZMQ drops what a publisher sends before a subscriber's subscription has reached it."""

    def __init__(self, tmp: Path, buffer: int) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.ep, self.rep_ep = f"ipc://{tmp}/kv", f"ipc://{tmp}/kv-replay"
        self.pub.bind(self.ep)
        self.rep = self.ctx.socket(zmq.ROUTER)
        self.rep.bind(self.rep_ep)
        self.buf: list[tuple[int, bytes]] = []
        self.buffer = buffer
        self.task = asyncio.create_task(self._serve())

    async def subscribed(self, topic: bytes) -> None:
        """Return once a subscriber's subscription to ``topic`` has reached the publisher."""
        while await self.pub.recv() != b"\x01" + topic:
            pass

    async def send(self, seq: int, payload: bytes, publish: bool = True) -> None:
        self.buf = [*self.buf, (seq, payload)][-self.buffer:]
        if publish:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    async def _serve(self) -> None:
        while True:
            cid, _, start = await self.rep.recv_multipart()
            s = int.from_bytes(start, "big")
            for seq, p in self.buf:
                if seq >= s:
                    await self.rep.send_multipart([cid, b"", b"kv", seq.to_bytes(8, "big"), p])
            await self.rep.send_multipart([cid, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(linger=0)
        self.rep.close(linger=0)
        self.ctx.term()


async def test_reader_replays_history_fills_gaps_and_reports_losses(tmp_path: Path) -> None:
    vllm = FakeVllm(tmp_path, buffer=4)
    got: list[tuple[int, list[int]]] = []
    lost: list[str] = []
    r = KvEventsReader(vllm.ep, vllm.rep_ep, "kv", lambda s, t, ops: got.append((s, ops[0].hashes)), lost.append)
    for s in range(3):  # before the reader exists: only the replay buffer has them
        await vllm.send(s, batch(s, 100 + s), publish=False)
    task = asyncio.create_task(r.run())
    await asyncio.wait_for(vllm.subscribed(b"kv"), HANG_S)  # the SUB socket's subscription arrived

    async def until(n: int) -> None:
        await wait_until(lambda: len(got) >= n, what=f"{n} batches delivered")

    await vllm.send(3, batch(3, 103))
    await until(4)
    assert [s for s, _ in got] == [0, 1, 2, 3] and r.replayed == 3
    await vllm.send(4, batch(4, 104), publish=False)  # lost on the way, still in the buffer
    await vllm.send(5, batch(5, 105))
    await until(6)
    assert [s for s, _ in got] == [0, 1, 2, 3, 4, 5] and not lost
    for s in range(6, 12):  # six missed: the buffer of 4 keeps only 9..12 once 12 is out
        await vllm.send(s, batch(s, 100 + s), publish=False)
    await vllm.send(12, batch(12, 112))
    await until(10)
    assert lost and r.lost_batches == 3 and [s for s, _ in got[6:]] == [9, 10, 11, 12]
    task.cancel()
    vllm.close()
