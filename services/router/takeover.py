"""Taking over a query whose router is gone (issue 41): a router that dies takes with it the
answers it was relaying, and their clients used to wait out their idle timeout. Its client, silent
for ``recover_s`` and holding ``n`` chunks, resubmits with ``takeover: n``; the router it reaches
reads the query's dedup claim (``bear.router.dedup``: the owner's name) and asks whether the owner
is there (``bear.router.alive.<digest>``, answered by every router while its connection lives).

The owner is gone only when NATS says so — "no responders" on ``GONE_PROBES`` probes spread over
``GONE_S`` (a live router reconnecting after a NATS restart is back within ``reconnect_time_wait``,
0.2 s, long before that). A probe answered, timed out or failing counts as alive: a query is never
run twice to save a wait. Gone, and no chunk reached the client: the claim is rewritten in this
router's name (compare-and-set on its revision, so two routers cannot both take it) and the query
runs here from the start; the dead router's engine request ended with its HTTP connection. Gone
after some chunks: the client gets a coded ``incomplete`` at once — its answer cannot be continued
by another engine — instead of waiting.

The residue, stated: a router cut off from NATS for longer than ``GONE_S`` while one of its
queries waits for its first token may find that query taken over when it comes back, and both
answers then reach the client's inbox."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from bear.protocol.subjects import Subjects
from bear.protocol.submit import TAKEOVER_PROBE_S

log = structlog.get_logger("bear.router")

GONE_PROBES = 3
GONE_S = TAKEOVER_PROBE_S  # the first and the last probe this far apart
PROBE_TIMEOUT_S = 0.5

Probe = Callable[[str], Awaitable[bool]]  # router name → True when NATS says nobody answers for it


class Liveness:
    """This router's answer to alive probes, and its probe of another router."""

    def __init__(self, nc: Any, subjects: Subjects, name: str) -> None:
        self.nc = nc
        self.subjects = subjects
        self.name = name
        self._sub: Any = None

    async def start(self) -> None:
        async def answer(msg: Any) -> None:
            if msg.reply:
                await self.nc.publish(msg.reply, b"")

        self._sub = await self.nc.subscribe(self.subjects.router_alive(self.name), cb=answer)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # closed with the connection
                pass

    async def nobody_answers(self, router: str) -> bool:
        """True only on NATS's "no responders" for ``router``'s alive subject."""
        from nats.errors import NoRespondersError

        try:
            await self.nc.request(self.subjects.router_alive(router), b"", timeout=PROBE_TIMEOUT_S)
        except NoRespondersError:
            return True
        except Exception:  # timed out, disconnected: not proof of anything
            return False
        return False

    async def gone(self, router: str, probes: int = GONE_PROBES, over_s: float = GONE_S) -> bool:
        """``router`` unanswered on every one of ``probes`` probes spread over ``over_s``."""
        for k in range(probes):
            if k:
                await asyncio.sleep(over_s / max(1, probes - 1))
            if not await self.nobody_answers(router):
                return False
        return True
