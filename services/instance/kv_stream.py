"""An instance's prefix-cache stream on ``bear.kv.<id>``: what each engine step did to the cache
(``bear.kv/1``), and on request the whole cache (``bear.kv.state/1``). Part of the instance
publisher, so the real-vLLM snapshotter (fed by vLLM's KV events) and the simulated engine (fed
by its own block cache) publish alike and a mirror cannot tell them apart.

The stream keeps its own mirror of everything it was given, so that it can answer a resync from
memory whatever the engine does. Rules (docs/contract.md, "Prefix-cache stream"):

* every publisher start is a new ``epoch``; its first message is the whole state (so mirrors
  listening then are synced at once), then events messages ``seq`` 0, 1, …;
* ``events`` is synchronous and cheap (engine loops call it); messages wait in a bounded queue —
  when it overflows or NATS is down they are dropped, ``seq`` still advances, and mirrors that
  see the gap ask for a state (``bear.kv.resync.<id>``); after a reconnect a state goes out
  unasked;
* a resync request is answered at most every ``min_state_interval_s`` by one state (in parts of
  at most ``state_chunk`` block names), published after the events queued before it.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from typing import Any

import structlog

from bear.prefix.mirror import PrefixMirror
from bear.protocol.errors import BearError
from bear.protocol.messages import KvEvents, KvOp, KvResync, KvState, decode, encode
from bear.protocol.subjects import Subjects

log = structlog.get_logger("bear.instance")


class KvStream:
    def __init__(self, instance: str, subjects: Subjects, *, buffer: int = 4096, state_chunk: int = 65536,
                 min_state_interval_s: float = 0.2) -> None:
        self.instance = instance
        self.subjects = subjects
        self.subject = subjects.kv(instance)
        self.epoch = uuid.uuid4().hex[:16]
        self.mirror = PrefixMirror(instance)
        self.mirror.install(KvState(instance=instance, epoch=self.epoch, seq=-1, t=time.time()))
        self.state_chunk = state_chunk
        self.min_state_interval_s = min_state_interval_s
        self._queue: deque[KvEvents] = deque()
        self._buffer = buffer
        self._state_wanted = True  # the epoch opens with its state
        self._state_sent = 0.0  # monotonic
        self._sub: Any = None
        self._sub_nc: Any = None
        self.complete = True
        self.published = 0
        self.dropped = 0
        self.states = 0
        self.resyncs = 0

    # ------------------------------------------------------------------ engine side (sync, cheap)
    def events(self, ops: list[KvOp], t: float | None = None) -> None:
        """What one step did to the cache, in the engine's order (empty: nothing)."""
        if not ops:
            return
        msg = KvEvents(instance=self.instance, epoch=self.epoch, seq=self.mirror.seq + 1,
                       t=time.time() if t is None else t, ops=ops)
        self.mirror.apply(msg)
        if len(self._queue) >= self._buffer:
            self._queue.popleft()
            self.dropped += 1
        self._queue.append(msg)

    def lost(self, why: str) -> None:
        """The source lost engine events it cannot recover: states say ``complete: false`` from
        now on (the engine's cache no longer matches what was published)."""
        if self.complete:
            log.error("kv_events_lost", instance=self.instance, why=why)
        self.complete = False
        self._state_wanted = True

    def restart(self) -> None:
        """A new engine (empty cache): the cache is cleared and the stream is whole again."""
        self.events([KvOp("cleared")])
        self.complete = True

    def request_state(self) -> None:
        self._state_wanted = True

    @property
    def pending(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ I/O side
    async def subscribe(self, nc: Any) -> None:
        """Answer resync requests on ``nc`` (once per connection object)."""
        if nc is None or self._sub_nc is nc:
            return
        self._sub = await nc.subscribe(self.subjects.kv_resync(self.instance), cb=self._on_resync)
        self._sub_nc = nc

    async def _on_resync(self, msg: Any) -> None:
        try:
            decode(KvResync, msg.data)
        except BearError:
            return
        self.resyncs += 1
        self._state_wanted = True

    def disconnected(self) -> None:
        """NATS is away: queued events are dropped (their seq stays used); a state follows."""
        self.dropped += len(self._queue)
        self._queue.clear()
        self._state_wanted = True

    async def publish(self, nc: Any) -> None:
        """Send the queued events, then a state if one is wanted (and allowed by the interval)."""
        while self._queue:
            msg = self._queue[0]
            await nc.publish(self.subject, encode(msg))
            self._queue.popleft()
            self.published += 1
        if self._state_wanted and time.monotonic() - self._state_sent >= self.min_state_interval_s:
            for part in self.state_parts():
                await nc.publish(self.subject, encode(part))
            self._state_wanted = False
            self._state_sent = time.monotonic()
            self.states += 1

    def state_parts(self) -> list[KvState]:
        data = self.mirror.dump()
        step = self.state_chunk * 8
        chunks = [data[k:k + step] for k in range(0, len(data), step)] or [b""]
        t = time.time()
        return [KvState(instance=self.instance, epoch=self.epoch, seq=self.mirror.seq, t=t, hashes=c, part=k,
                        parts=len(chunks), complete=self.complete) for k, c in enumerate(chunks)]
