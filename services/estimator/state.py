"""What one estimator worker knows about one instance, fed only from NATS: the newest snapshot
(kept raw, parsed lazily so a burst of snapshots costs one parse), predicted output lengths of
the requests the router dispatched there, dispatch-rate statistics for the analytic fallback,
the calibrated β, and the registry heartbeat."""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from bear import libbea
from bear.calibrator.fit import NOMINAL_BETA

MAX_LENGTHS_PER_INSTANCE = 50_000  # predicted lengths kept (oldest forgotten first)
EWMA = 0.05


@dataclass
class CalibrationEntry:
    beta: tuple[float, float, float, float] = NOMINAL_BETA
    theta: float | None = None  # prefill tokens/s (eq. 8) when the calibrator measured it
    mape: float = math.nan
    n: int = 0
    calibrated: bool = False


@dataclass
class InstanceState:
    instance: str
    raw: bytes | None = None  # newest snapshot, not parsed yet
    raw_received: float = 0.0
    snap: Any = None  # libbea.Snapshot
    snap_time: float = 0.0  # capture time (the snapshot's own clock)
    snap_received: float = 0.0  # local receipt time of the parsed snapshot
    snap_ids: list[str] = field(default_factory=list)
    lengths: OrderedDict[str, int] = field(default_factory=OrderedDict)
    lengths_dirty: bool = False
    arrivals: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    mean_prompt: float | None = None
    mean_output: float | None = None
    mean_running: float | None = None
    max_num_seqs: int | None = None
    calibration: CalibrationEntry = field(default_factory=CalibrationEntry)
    registry_heartbeat: float = 0.0

    # ------------------------------------------------------------------ feeds
    def offer_snapshot(self, data: bytes, now: float) -> bool:
        """Keep only the newest; returns True when an unparsed one was replaced (dropped)."""
        dropped = self.raw is not None
        self.raw = data
        self.raw_received = now
        return dropped

    def ensure_parsed(self) -> bool | None:
        """Parse the pending snapshot if any: None (nothing pending), True (parsed and kept),
        False (malformed: dropped, the previous one is kept)."""
        data = self.raw
        if data is None:
            return None
        self.raw = None
        try:
            snap = libbea.Snapshot.from_msgpack(data)
        except ValueError:
            return False
        if self.snap is not None and snap.seq < self.snap.seq and snap.time < self.snap_time:
            return None  # reordered older snapshot: ignore
        self.snap = snap
        self.snap_time = float(snap.time)
        self.snap_received = self.raw_received
        self.snap_ids = list(snap.request_ids)
        self.max_num_seqs = int(snap.max_num_seqs)
        r = float(snap.n_running)
        if r > 0:
            self.mean_running = r if self.mean_running is None else (1 - EWMA) * self.mean_running + EWMA * r
        self.lengths_dirty = True
        return True

    def apply_lengths(self) -> None:
        if not self.lengths_dirty or self.snap is None:
            return
        known = {rid: self.lengths[rid] for rid in self.snap_ids if rid in self.lengths}
        if known:
            self.snap.set_output_lengths(known)
        self.lengths_dirty = False

    def on_dispatch(self, request_id: str, prompt_tokens: int, predicted_output: int, t: float) -> None:
        self.lengths[request_id] = predicted_output
        self.lengths.move_to_end(request_id)
        while len(self.lengths) > MAX_LENGTHS_PER_INSTANCE:
            self.lengths.popitem(last=False)
        self.lengths_dirty = True
        self.arrivals.append(t)
        self.mean_prompt = _ewma(self.mean_prompt, float(prompt_tokens))
        self.mean_output = _ewma(self.mean_output, float(predicted_output))

    # ------------------------------------------------------------------ derived
    def age(self, now: float) -> float | None:
        """Seconds since the parsed snapshot's capture (None: never had one)."""
        if self.snap is None:
            return None
        return max(0.0, now - self.snap_time)

    def arrival_stats(self, now: float, window_s: float = 60.0) -> tuple[float, float | None]:
        """(α dispatches/s over the window, squared CV of inter-arrival times or None)."""
        ts = [t for t in self.arrivals if now - t <= window_s]
        if len(ts) < 2:
            return 0.0, None
        span = max(now - ts[0], 1e-6)
        alpha = len(ts) / span
        gaps = [b - a for a, b in itertools.pairwise(ts)]
        if len(gaps) < 20:
            return alpha, None
        m = sum(gaps) / len(gaps)
        var = sum((g - m) ** 2 for g in gaps) / (len(gaps) - 1)
        return alpha, (var / (m * m) if m > 0 else None)


def _ewma(prev: float | None, x: float) -> float:
    return x if prev is None else (1 - EWMA) * prev + EWMA * x


class StateStore:
    """All instances one worker knows, created on first mention."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceState] = {}

    def get(self, instance: str) -> InstanceState:
        st = self.instances.get(instance)
        if st is None:
            st = InstanceState(instance)
            self.instances[instance] = st
        return st

    def peek(self, instance: str) -> InstanceState | None:
        return self.instances.get(instance)


def now() -> float:
    return time.time()
