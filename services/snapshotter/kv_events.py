"""vLLM's KV cache events (``--kv-events-config``, the ZMQ publisher) → the instance's prefix-cache
stream on NATS (``bear.instance.kv_stream``).

vLLM publishes, after every step that changed its prefix cache, one ``KVEventBatch`` (``ts``,
``events``) as a ZMQ multipart ``(topic, seq as 8 bytes big-endian, msgpack payload)`` on a PUB
socket, and keeps the last ``buffer_steps`` batches for a ROUTER "replay" socket that resends
every batch from a given seq (``vllm/distributed/kv_events.py``). Events are ``BlockStored``
(block hashes, parent hash, token ids), ``BlockRemoved`` (hashes) and ``AllBlocksCleared``.

The reader subscribes to the PUB socket, checks vLLM's seq, and fills a gap (or a late start:
the first batch seen is not seq 0) from the replay socket; what the replay buffer no longer holds
is lost for good, and the stream says so (``KvStream.lost``). Only the GPU tier's first KV cache
group is mirrored; hashes become BEAR's int names (``bear.prefix.hashing.external``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from bear.prefix.hashing import external
from bear.protocol.messages import KvOp

log = structlog.get_logger("bear.snapshotter")

END_SEQ = -1  # the replay socket's end-of-replay marker (seq −1)


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[dict[str, Any]]  # tagged maps ("type"); kinds this reader does not know are skipped
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(_Batch)


def _name(h: int | bytes) -> int:
    return external(h) if isinstance(h, bytes) else h & ((1 << 64) - 1)


def to_ops(payload: bytes) -> tuple[float, list[KvOp]]:
    """One vLLM batch as (its time, BEAR's ops); ValueError when it does not decode."""
    try:
        batch = _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"undecodable KV event batch: {exc}") from exc
    ops: list[KvOp] = []
    for ev in batch.events:
        kind = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}.get(ev.get("type"))
        if kind == "cleared":
            ops.append(KvOp("cleared"))
            continue
        if kind is None or ev.get("medium") not in (None, "GPU") or ev.get("group_idx") not in (None, 0):
            continue  # another event kind, tier or KV cache group: not the cache admission reads
        raw = ev.get("block_hashes")
        if not isinstance(raw, list) or not all(isinstance(h, int | bytes) for h in raw):
            raise ValueError("block_hashes must be a list of ints or bytes")
        hashes = [_name(h) for h in raw]
        if ops and ops[-1].kind == kind:
            ops[-1].hashes.extend(hashes)
        else:
            ops.append(KvOp(kind, hashes))
    return batch.ts, ops


def connect_endpoint(endpoint: str) -> str:
    """Where a subscriber connects for a publisher ``endpoint`` (``tcp://*:p`` binds every
    interface: connect to loopback)."""
    return endpoint.replace("://*:", "://127.0.0.1:").replace("://0.0.0.0:", "://127.0.0.1:")


class KvEventsReader:
    """Read one engine's KV events; hand each batch to ``on_batch(seq, ts, ops)`` in vLLM's
    order, and ``on_lost(why)`` when batches could not be recovered."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str,
                 on_batch: Callable[[int, float, list[KvOp]], None], on_lost: Callable[[str], None], *,
                 replay_timeout_s: float = 2.0) -> None:
        self.endpoint = connect_endpoint(endpoint)
        self.replay_endpoint = connect_endpoint(replay_endpoint) if replay_endpoint else None
        self.topic = topic
        self.on_batch = on_batch
        self.on_lost = on_lost
        self.replay_timeout_s = replay_timeout_s
        self.expected: int | None = None  # the next vLLM seq; None: nothing seen since (re)start
        self.batches = 0
        self.replayed = 0
        self.lost_batches = 0
        self.malformed = 0
        self._ctx: Any = None
        self._sub: Any = None

    def restart(self) -> None:
        """A new engine: its seq starts again at 0."""
        self.expected = None

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 1_000_000)
        self._sub.connect(self.endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        log.info("kv_events_subscribed", endpoint=self.endpoint, replay=self.replay_endpoint)
        try:
            while True:
                frames = await self._sub.recv_multipart()
                if len(frames) != 3:
                    self.malformed += 1
                    continue
                await self._take(int.from_bytes(frames[1], "big", signed=True), frames[2])
        finally:
            self._sub.close(linger=0)
            self._ctx.term()

    async def _take(self, seq: int, payload: bytes) -> None:
        if self.expected is None and seq > 0:
            await self._replay(0, seq)  # started after the engine: its history first
        elif self.expected is not None and seq > self.expected:
            await self._replay(self.expected, seq)
        elif self.expected is not None and seq < self.expected:
            return  # already had it (a replayed batch arriving live too)
        self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        try:
            ts, ops = to_ops(payload)
        except ValueError:
            self.malformed += 1
            ops, ts = [], 0.0
        self.expected = seq + 1
        self.batches += 1
        self.on_batch(seq, ts, ops)

    async def _replay(self, start: int, until: int) -> None:
        """Batches start … until−1 from the replay socket; what it cannot give is lost."""
        got = await self._fetch_replay(start, until) if self.replay_endpoint else []
        nxt = start
        for seq, payload in [*sorted(x for x in got if start <= x[0] < until), (until, b"")]:
            if seq < nxt:
                continue
            if seq > nxt:  # older than the buffer: gone (the later ones still make the mirror better)
                self.lost_batches += seq - nxt
                self.on_lost(f"vLLM KV event batches {nxt}..{seq - 1} lost (not in the replay buffer)")
                self.expected = seq
            if seq == until:
                break
            self._deliver(seq, payload)
            self.replayed += 1
            nxt = seq + 1

    async def _fetch_replay(self, start: int, until: int) -> list[tuple[int, bytes]]:
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self.replay_timeout_s)
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                out.append((seq, frames[3]))
                if seq >= until - 1:
                    break
        except TimeoutError:
            log.warning("kv_replay_timeout", start=start, until=until, got=len(out))
        finally:
            with contextlib.suppress(Exception):
                sock.close(linger=0)
        return out
