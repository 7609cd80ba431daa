"""Cancels heard on ``bear.cancel``: every router hears every cancel (no queue group), remembers
the id with the inbox it named for a while — a cancel may overtake its own submission, which is
then not started — and counts it only from whoever holds the answer's inbox (which only that
client and the router serving it know: a query id alone is not enough)."""

from __future__ import annotations

import time
from collections import OrderedDict

from bear.protocol.submit import decode_cancel

CANCEL_MEMORY = 4096  # ids of cancelled queries remembered
CANCEL_MEMORY_S = 60.0


class Cancels:
    def __init__(self, memory: int = CANCEL_MEMORY, memory_s: float = CANCEL_MEMORY_S) -> None:
        self.memory = memory
        self.memory_s = memory_s
        self._heard: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id → (monotonic time, inbox)

    def hear(self, data: bytes) -> str | None:
        """Remember a ``bear.cancel/1`` (a malformed one is dropped); the query id it names."""
        c = decode_cancel(data)
        if c is None:
            return None
        now = time.monotonic()
        self._heard[c.query_id] = (now, c.inbox)
        self._heard.move_to_end(c.query_id)
        while self._heard and (len(self._heard) > self.memory
                               or now - next(iter(self._heard.values()))[0] > self.memory_s):
            self._heard.popitem(last=False)
        return c.query_id

    def cancelled(self, query_id: str, inbox: str) -> bool:
        """Whether the holder of ``inbox`` cancelled ``query_id``."""
        c = self._heard.get(query_id)
        return c is not None and c[1] == inbox

    def __contains__(self, query_id: object) -> bool:
        return query_id in self._heard
