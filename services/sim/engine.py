"""The simulated instance's engine loop: libbea.Engine (vLLM V1 sync scheduling, the same
Scheduler the BEA replay uses) stepped in real time, each step lasting a roofline draw.

Time: a virtual clock advances by exactly each step's drawn duration and the loop sleeps until
the wall clock reaches it, so sleep overshoot never accumulates; if processing ever falls behind by
more than ``max_lag_s`` the clock is re-synchronised to the wall clock and the event is counted
(``stats.resyncs``), which is how "keeps up with the wall clock" is measured. Token times, TTFTs,
snapshot times and batch durations are all read off the virtual clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from bear import libbea
from bear.instance.publisher import InstancePublisher
from bear.protocol.batch import BatchRecord
from bear.protocol.messages import KvOp
from bear.sim.lengths import OutputLengths
from bear.sim.profile import Profile
from bear.sim.roofline import RooflineModel


@dataclass
class SimRequest:
    """One request's progress, read by the HTTP layer (``changed`` fires on every new token)."""

    id: str
    prompt_tokens: int
    max_tokens: int
    true_output_tokens: int
    arrival: float
    output_tokens: int = 0
    finished: bool = False
    aborted: bool = False
    first_token_at: float | None = None
    finished_at: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def finish_reason(self) -> str:
        return "length" if self.output_tokens >= self.max_tokens else "stop"


@dataclass
class SimStats:
    steps: int = 0
    busy_s: float = 0.0
    max_lag_s: float = 0.0
    lag_sum_s: float = 0.0
    resyncs: int = 0  # times processing fell more than max_lag_s behind the wall clock
    requests: int = 0
    finished: int = 0
    aborted: int = 0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["mean_lag_s"] = self.lag_sum_s / self.steps if self.steps else 0.0
        return d


class SimEngine:
    def __init__(
        self,
        profile: Profile,
        instance: str,
        publisher: InstancePublisher | None = None,
        *,
        seed: int | None = None,
        lengths: OutputLengths | None = None,
        max_lag_s: float = 0.05,
        keep_finished: int = 100_000,
    ) -> None:
        self.profile = profile
        self.instance = instance
        self.model_name = profile.model
        self.engine = libbea.Engine(profile.engine_config())
        self.time_model = RooflineModel(profile, seed=seed)
        self.lengths = lengths or OutputLengths()
        self.publisher = publisher
        self.max_lag_s = max_lag_s
        self.stats = SimStats()
        self._live: dict[str, SimRequest] = {}
        self.finished: OrderedDict[str, SimRequest] = OrderedDict()
        self._keep_finished = keep_finished
        self.step_log: deque[tuple[float, float]] = deque(maxlen=10_000)  # (virtual end, duration)
        self._wake = asyncio.Event()
        self._stopping = False
        self._vclock = time.time()

    @property
    def max_model_len(self) -> int:
        return int(self.engine.config["max_model_len"])

    # ------------------------------------------------------------------ requests
    def submit(self, request_id: str, prompt_tokens: int, max_tokens: int, true_output_tokens: int,
               priority: int = 0, block_hashes: list[int] | None = None) -> SimRequest:
        """Queue a request (ValueError on bad sizes or a duplicate live id); ``block_hashes``: vLLM's
        hashes of its prompt's full blocks (the engine's prefix cache hits and keeps them)."""
        if request_id in self._live:
            raise ValueError(f"duplicate request id {request_id!r}")
        now = time.time()
        true_out = max(1, min(true_output_tokens, max_tokens))
        self.engine.add(request_id, prompt_tokens, max_tokens, true_out, now, priority, block_hashes=block_hashes or [])
        req = SimRequest(request_id, prompt_tokens, max_tokens, true_out, now)
        self._live[request_id] = req
        self.stats.requests += 1
        self._wake.set()
        return req

    def abort(self, request_id: str) -> bool:
        req = self._live.pop(request_id, None)
        if req is None:
            return False
        self.engine.abort(request_id)
        req.aborted = True
        req.finished = True
        req.changed.set()
        self.stats.aborted += 1
        self._wake.set()
        return True

    def ttft(self, request_id: str) -> float | None:
        req = self._live.get(request_id) or self.finished.get(request_id)
        return None if req is None else req.ttft_s

    # ------------------------------------------------------------------ loop
    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def publish_snapshot(self, at: float) -> None:
        if self.publisher is not None:
            self.publisher.snapshot(self.engine.snapshot(self.instance, self.model_name, at))

    async def run(self) -> None:
        self.publish_snapshot(time.time())
        last_end: float | None = None  # the previous step's end while the engine stayed busy
        while not self._stopping:
            if not self.engine.has_work:
                self._wake.clear()
                await self._wake.wait()
                self._vclock = time.time()
                last_end = None
                continue
            now = time.time()
            if now - self._vclock > self.max_lag_s:
                self.stats.resyncs += 1
                self._vclock = now
            start = self._vclock
            batch = self.engine.step()
            if not batch:  # nothing fits (KV full, nothing running): wait for an abort/arrival
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.05)
                self._vclock = time.time()
                last_end = None
                continue
            duration = self.time_model.sample([(n, ctx) for _, n, ctx, _ in batch])
            end = start + duration
            delay = end - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            outputs = self.engine.finish_step()
            self._vclock = end
            if self.publisher is not None and self.engine.prefix_caching:  # vLLM publishes a step's events at its end
                self.publisher.kv_events([KvOp(kind, hashes) for kind, hashes in self.engine.take_kv_events()], end)
            lag = max(0.0, time.time() - end)
            self.stats.steps += 1
            self.stats.busy_s += duration
            self.stats.lag_sum_s += lag
            self.stats.max_lag_s = max(self.stats.max_lag_s, lag)
            self.step_log.append((end, duration))
            self._deliver(outputs, end)
            # The loop period, as vLLM's is measured: from the previous step's end. It is the drawn
            # duration unless the process fell behind the wall clock (a starved host: the virtual
            # clock was re-synchronised), and then the lost time is the engine's too — a record of
            # the drawn duration alone would hide from the calibrator an engine running slower than
            # its model, while its first tokens come that much later.
            period = end - last_end if last_end is not None else duration
            last_end = end
            if self.publisher is not None:
                self.publisher.batch(
                    BatchRecord(
                        seq=self.engine.seq,
                        # loop period while the engine stays busy (bear.batch/1), null otherwise
                        duration_s=period if self.engine.has_work else None,
                        items=[{"n": n, "context": ctx, "decode": dec} for _, n, ctx, dec in batch],
                    )
                )
            self.publish_snapshot(end)

    def _deliver(self, outputs: list[tuple[str, int, bool]], at: float) -> None:
        for rid, out_tokens, fin in outputs:
            req = self._live.get(rid)
            if req is None:
                continue
            req.output_tokens = out_tokens
            if req.first_token_at is None:
                req.first_token_at = at
            if fin:
                req.finished = True
                req.finished_at = at
                del self._live[rid]
                self.finished[rid] = req
                self.stats.finished += 1
                while len(self.finished) > self._keep_finished:
                    self.finished.popitem(last=False)
            req.changed.set()
