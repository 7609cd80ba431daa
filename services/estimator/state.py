"""What an estimator knows about one instance: the newest snapshot (a full one kept raw and parsed
lazily, so a burst of snapshots costs one parse; then kept current by the per-step deltas,
``bear.estimator.delta_ingest``), the router's dispatches there (their predicted output lengths, the
ones the snapshot does not show yet, the rate of prompt tokens), the calibration, the registry
entry (heartbeat, engine config, how its prefix cache hashes blocks) and the mirror of its prefix
cache (``bear.prefix.mirror``). Fed by the worker from NATS and by ``bear eval`` from its
simulated instances, through the same methods."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bear import libbea
from bear.estimator import delta_ingest
from bear.prefix.hashing import HashSpec
from bear.prefix.hits import Hashers
from bear.prefix.mirror import PrefixMirror
from bear.protocol.engine_ids import dispatch_id
from bear.protocol.messages import NOMINAL_CALIBRATION, Calibration, Dispatch, InstanceRecord

MAX_LENGTHS_PER_INSTANCE = 50_000  # predicted lengths kept (oldest forgotten first)
MAX_CLOCK_SKEW_S = 2.0  # a snapshot stamped further in the future than this is refused
MAX_SEEN_IDS = 50_000  # request ids some snapshot has shown (oldest forgotten first)
DISPATCH_LOG_S = 60.0  # dispatches kept this long (rate window and "ahead" horizon are shorter)
EWMA = 0.05


@dataclass
class InstanceState:
    instance: str
    raw: bytes | None = None  # newest snapshot, not parsed yet
    raw_received: float = 0.0
    snap: Any = None  # libbea.Snapshot
    snap_time: float = 0.0  # capture time (the instance's clock)
    snap_received: float = 0.0
    in_use: int = 0  # replays running on ``snap`` off the event loop: its lengths must not change
    lengths: OrderedDict[str, int] = field(default_factory=OrderedDict)  # as the replay takes them (scaled)
    predicted: OrderedDict[str, int] = field(default_factory=OrderedDict)  # as the router predicted them
    length_scale: float = 1.0  # the calibration's length_scale (bear.calibrator.lengths)
    lengths_dirty: bool = False  # every resident's prediction is to be handed to libbea (a new snapshot)
    late_lengths: dict[str, int] = field(default_factory=dict)  # predictions of ids already seen
    gapped: bool = False  # a delta did not chain onto the state held: no BEA estimate until a full one
    feed: delta_ingest.DeltaFeed = field(default_factory=delta_ingest.DeltaFeed)
    on_event: Callable[[str], None] | None = None  # counts ingest events (the worker's metrics)
    # dispatch ids some snapshot has held → the engine's ids of them (vLLM's own, n children:
    # ``bear.protocol.engine_ids``)
    seen: OrderedDict[str, list[str]] = field(default_factory=OrderedDict)
    _in_flight: tuple[tuple[int, float], float] | None = None  # (state key, its step's eq. 12 seconds)
    dispatches: deque[Dispatch] = field(default_factory=deque)  # in time order
    mean_prompt: float | None = None
    mean_output: float | None = None
    mean_running: float | None = None
    max_num_seqs: int | None = None
    calibration: Calibration = NOMINAL_CALIBRATION
    calibrated: bool = False
    registry_heartbeat: float = 0.0
    nbytes: int = 0  # size of the newest snapshot message (what the store's byte budget counts)
    engine_config: dict[str, Any] | None = None  # the registry's copy of the engine's scheduler config
    prefix: PrefixMirror = field(default_factory=PrefixMirror)
    prefix_spec: HashSpec | None = None  # None: prefix caching off, or the instance says nothing of it
    prefix_events: bool = False  # the instance publishes its cache (bear.kv.<id>)
    prefix_problem: str | None = None  # why its registry entry's prefix cache cannot be mirrored
    resync_asked: float = 0.0  # monotonic time of the last resync request sent for its mirror

    def __post_init__(self) -> None:
        self.prefix.instance = self.instance

    # ------------------------------------------------------------------ feeds
    def on_registry(self, rec: InstanceRecord) -> None:
        """The instance's registry entry: heartbeat, engine config, prefix-cache hashing."""
        self.registry_heartbeat = rec.heartbeat
        if rec.config is not None:
            self.engine_config = dict(rec.config)
        pc = rec.prefix_cache
        self.prefix_events = bool(pc is not None and pc.enabled and pc.events)
        self.prefix_spec, self.prefix_problem = None, None
        if pc is not None and pc.enabled:
            try:
                self.prefix_spec = HashSpec(algo=pc.hash_algo, block_size=pc.block_size, seed=pc.hash_seed)
            except ValueError as exc:
                self.prefix_problem = str(exc)

    def offer_snapshot(self, data: bytes, now: float) -> bool:
        """Keep only the newest raw snapshot; True when an unparsed one was replaced (dropped)."""
        dropped = self.raw is not None
        self.raw = data
        self.raw_received = now
        return dropped

    def ensure_parsed(self) -> bool | None:
        """Parse the pending raw snapshot if any: None (nothing new), True (installed), False
        (refused: malformed, or stamped in the future; the previous one is kept)."""
        data = self.raw
        if data is None:
            return None
        self.raw = None
        try:
            snap = libbea.Snapshot.from_msgpack(data)
            ids = snap.request_ids  # ValueError (UnicodeDecodeError) on ids that are not UTF-8
        except ValueError:
            return False
        t = float(snap.time)
        if t > self.raw_received + MAX_CLOCK_SKEW_S:
            return False  # a future time would outlive every real snapshot after it
        delta_ingest.check_full(self, snap)
        return self.install(snap, t, self.raw_received, ids)

    def offer_delta(self, data: bytes, now: float) -> str:
        """Apply one ``bear.delta/1`` message (``bear.estimator.delta_ingest``); what happened."""
        return delta_ingest.offer_delta(self, data, now)

    def delta_applied(self, added: list[str], snap_time: float, received: float) -> None:
        """libbea applied a delta to ``snap``: the new capture time, the arrivals now seen."""
        self.snap_time = snap_time
        self.snap_received = received
        self.see(added)
        r = float(self.snap.n_running)
        if r > 0:
            self.mean_running = _ewma(self.mean_running, r)

    def see(self, ids: Iterable[str]) -> None:
        """Requests some state of the engine has shown (the engine's ids): a dispatch among them
        is no longer ahead."""
        seen = self.seen
        for rid in ids:
            did = dispatch_id(rid)
            names = seen.get(did)
            if names is None:
                seen[did] = [rid]
            elif rid not in names:
                names.append(rid)
        while len(seen) > MAX_SEEN_IDS:
            seen.popitem(last=False)

    def lengths_of(self, ids: Iterable[str]) -> dict[str, int]:
        """The router's predicted lengths of the engine's requests ``ids`` (named the engine's way;
        each of a query's n sequences gets the query's per-sequence prediction)."""
        lengths = self.lengths
        out: dict[str, int] = {}
        for rid in ids:
            n = lengths.get(rid)
            if n is None:
                n = lengths.get(dispatch_id(rid))
            if n is not None:
                out[rid] = n
        return out

    def event(self, name: str) -> None:
        if self.on_event is not None:
            self.on_event(name)

    def install(self, snap: Any, snap_time: float, received: float, ids: list[str] | None = None) -> bool | None:
        """Make ``snap`` (captured at ``snap_time``) the current state; None if it is older than
        the one held in both step and time (reordered delivery)."""
        if self.snap is not None and snap.seq < self.snap.seq and snap_time < self.snap_time:
            return None
        self.snap = snap
        self.snap_time = snap_time
        self.snap_received = received
        self.see(snap.request_ids if ids is None else ids)
        self.max_num_seqs = int(snap.max_num_seqs)
        r = float(snap.n_running)
        if r > 0:
            self.mean_running = _ewma(self.mean_running, r)
        self.lengths_dirty = True
        self.late_lengths.clear()
        delta_ingest.catch_up(self, received)
        return True

    def on_dispatch(self, d: Dispatch, now: float | None = None) -> bool:
        """Take one dispatch; False (refused) when it is stamped more than MAX_CLOCK_SKEW_S after
        ``now``: it would sort after every real dispatch and stay "ahead" of each new query."""
        if now is not None and d.t > now + MAX_CLOCK_SKEW_S:
            return False
        self.predicted[d.request_id] = d.predicted_output_tokens
        self.predicted.move_to_end(d.request_id)
        self.lengths[d.request_id] = n = self.scaled(d.predicted_output_tokens)
        self.lengths.move_to_end(d.request_id)
        while len(self.lengths) > MAX_LENGTHS_PER_INSTANCE:
            self.lengths.popitem(last=False)
            self.predicted.popitem(last=False)
        for rid in self.seen.get(d.request_id, ()):  # already resident: hand it over with the next estimate
            self.late_lengths[rid] = n
        # else it reaches libbea when it arrives: in a delta (looked up there) or a full snapshot
        if self.dispatches and d.t < self.dispatches[-1].t:  # clock skew between routers: keep order
            d = msgspec.structs.replace(d, t=self.dispatches[-1].t)
        self.dispatches.append(d)
        while self.dispatches and self.dispatches[0].t < d.t - DISPATCH_LOG_S:
            self.dispatches.popleft()
        self.mean_prompt = _ewma(self.mean_prompt, float(d.prompt_tokens))
        self.mean_output = _ewma(self.mean_output, float(d.predicted_output_tokens))
        return True

    def scaled(self, predicted: int) -> int:
        """A predicted output length as the replay takes it: times the instance's length scale."""
        return predicted if self.length_scale == 1.0 else max(1, min(round(predicted * self.length_scale), 2**31 - 1))

    def set_calibration(self, cal: Calibration | None) -> None:
        """The instance's calibration (None: none, the nominal β): β, θ, and the length scale —
        a new scale re-scales every known prediction and hands them all to libbea again."""
        self.calibration, self.calibrated = (cal, True) if cal is not None else (NOMINAL_CALIBRATION, False)
        scale = (cal.length_scale if cal is not None else None) or 1.0
        if scale != self.length_scale:
            self.length_scale = scale
            self.lengths = OrderedDict((rid, self.scaled(n)) for rid, n in self.predicted.items())
            self.lengths_dirty = True

    def apply_lengths(self) -> None:
        """Hand the predicted lengths of the snapshot's residents to libbea (all of them for a new
        full snapshot, else those dispatched after their request was seen; never while a replay off
        the loop reads the snapshot)."""
        if self.snap is None or self.in_use or not (self.lengths_dirty or self.late_lengths):
            return
        if self.lengths_dirty:
            known = self.lengths_of(self.snap.request_ids)
        else:
            known = self.late_lengths
        if known:
            self.snap.set_output_lengths(known)
        self.lengths_dirty = False
        self.late_lengths = {}

    # ------------------------------------------------------------------ derived
    def kv_blocks(self) -> tuple[int, int, int]:
        """(block size, blocks in use, usable blocks) of the held snapshot (zeros when the engine
        config or the snapshot is unknown). vLLM's null block is not usable; cached blocks no
        request holds count as free, as vLLM's KV usage counts them."""
        cfg = self.engine_config
        if self.snap is None or not cfg:
            return 0, 0, 0
        total = max(0, int(cfg.get("num_gpu_blocks") or 0) - 1)
        return int(cfg.get("block_size") or 0), max(0, total - int(self.snap.free_blocks)), total

    def step_in_flight_s(self, cfg: Any) -> float:
        """Eq. 12 seconds of the step the engine runs from the held state (sync mode): the state
        stays current that long, however long the step (one cached per state)."""
        snap = self.snap
        if snap is None:
            return 0.0
        key = (snap.seq, self.snap_time)
        if self._in_flight is None or self._in_flight[0] != key:
            try:
                s = libbea.next_step_s(snap, self.calibration.coefficients, cfg.default_output_tokens,
                                       cfg.overrun_fraction)
            except ValueError:  # a broken or malformed state: no credit for a step in flight
                s = 0.0
            self._in_flight = (key, s)
        return self._in_flight[1]

    def age(self, now: float) -> float | None:
        """Seconds since the held snapshot's capture (None: never had one)."""
        if self.snap is None:
            return None
        return max(0.0, now - self.snap_time)

    def ahead(self, grace_s: float, keys_of: Callable[[bytes], list[int]] | None = None) -> list[dict[str, Any]]:
        """Dispatches the snapshot cannot show yet: sent after its capture (less ``grace_s`` for
        the engine's admission delay and clock skew) and never seen in any snapshot. They queue
        in front of a new query. ``keys_of``: a dispatch's token ids → its block keys (a snapshot
        that describes the pool block by block)."""
        out: list[dict[str, Any]] = []
        since = self.snap_time - grace_s
        for d in reversed(self.dispatches):
            if d.t <= since:
                break
            if d.request_id not in self.seen:
                out.append(self.replay_request(d, keys_of))
        out.reverse()
        return out

    def reserved(self, dispatches: Sequence[Dispatch],
                 keys_of: Callable[[bytes], list[int]] | None = None) -> list[dict[str, Any]]:
        """A caller's dispatches here that this state does not hold (``EstimateRequest.ahead``:
        the router's reservations, a burst's queries before the one estimated), as the replay
        queues them behind ``ahead``'s. One it holds — heard on ``bear.dispatch`` or seen in a
        snapshot — is already counted there, or running."""
        return [self.replay_request(d, keys_of) for d in dispatches
                if d.request_id not in self.predicted and d.request_id not in self.seen]

    def replay_request(self, d: Dispatch, keys_of: Callable[[bytes], list[int]] | None = None) -> dict[str, Any]:
        """A dispatch as the replay queues it: its predicted length times the length scale."""
        r: dict[str, Any] = d.as_replay_request()
        if self.length_scale != 1.0:
            r["predicted_output"] = self.scaled(r["predicted_output"])
            if d.max_tokens is None:  # the prediction was the cap: the scaled one is
                r["max_tokens"] = r["predicted_output"]
        if keys_of is not None and d.tokens:
            r["block_keys"] = keys_of(d.tokens)
        return r

    def arrival_rate(self, now: float, window_s: float) -> tuple[float, float]:
        """(prompt tokens/s, dispatches/s) sent here over the last ``window_s``: the later
        arrivals a replay expects (a query's n sequences are one arrival)."""
        span = min(window_s, max(now, 1e-9))
        total = count = 0
        for d in reversed(self.dispatches):
            if d.t <= now - span:
                break
            total += d.prompt_tokens
            count += 1
        return total / span, count / span

    def arrival_stats(self, now: float, window_s: float = 60.0) -> tuple[float, float | None]:
        """(α dispatches/s over the window, squared CV of inter-arrival times or None)."""
        ts = [d.t for d in self.dispatches if now - d.t <= window_s]
        if len(ts) < 2:
            return 0.0, None
        alpha = len(ts) / max(now - ts[0], 1e-6)
        gaps = [b - a for a, b in itertools.pairwise(ts)]
        if len(gaps) < 20:
            return alpha, None
        m = sum(gaps) / len(gaps)
        var = sum((g - m) ** 2 for g in gaps) / (len(gaps) - 1)
        return alpha, (var / (m * m) if m > 0 else None)


def _ewma(prev: float | None, x: float) -> float:
    return x if prev is None else (1 - EWMA) * prev + EWMA * x


class StateStore:
    """All instances one estimator knows, created on first mention and bounded in number and in
    bytes: past ``max_instances``, or past ``max_bytes`` of snapshot messages held, the instance
    mentioned least recently is forgotten (a flood of snapshots for made-up instance ids cannot
    grow the worker without bound)."""

    def __init__(self, max_instances: int = 4096, max_bytes: int = 256 << 20,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.instances: OrderedDict[str, InstanceState] = OrderedDict()
        self.max_instances = max_instances
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evicted = 0
        self.on_event = on_event
        self.hashers = Hashers()  # vLLM block hashers, one per hash spec (NONE_HASH computed once)

    def offer(self, instance: str, data: bytes, now: float) -> bool:
        """``InstanceState.offer_snapshot`` within the byte budget; True when an unparsed
        snapshot was replaced."""
        st = self.get(instance)
        self.nbytes += len(data) - st.nbytes
        st.nbytes = len(data)
        dropped = st.offer_snapshot(data, now)
        while self.nbytes > self.max_bytes and len(self.instances) > 1:
            _, old = self.instances.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evicted += 1
        return dropped

    def get(self, instance: str) -> InstanceState:
        st = self.instances.get(instance)
        if st is None:
            st = self.instances[instance] = InstanceState(instance, on_event=self.on_event)
            while len(self.instances) > self.max_instances:
                _, old = self.instances.popitem(last=False)
                self.nbytes -= old.nbytes
                self.evicted += 1
        else:
            self.instances.move_to_end(instance)
        return st

    def forget(self, instance: str) -> None:
        old = self.instances.pop(instance, None)
        if old is not None:
            self.nbytes -= old.nbytes

    def peek(self, instance: str) -> InstanceState | None:
        return self.instances.get(instance)


def is_finite(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x)
