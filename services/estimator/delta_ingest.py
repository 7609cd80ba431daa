"""Delta ingest: an instance's held state kept current by its per-step deltas (``bear.delta/1``),
applied to the held libbea snapshot in C++ on the worker's event loop (no Python object per
resident), with gap detection, reordering and the need for a resync (docs/estimator.md, "Ingest").
It works on any ``DeltaTarget`` (``bear.estimator.state.InstanceState`` is the one the worker
holds): this module does not import the state module, the state module imports it.

* A delta applies when the state held is the one it names (generation, base seq and that state's
  capture time: an engine's initial state and its first step share seq 0): libbea changes the
  snapshot in place; the arrivals get their predicted lengths from the router's dispatches.
* A delta for a state already passed (same generation, seq at most the one held) is old: ignored.
* Any other delta — another base, another generation, no state held — is a gap: the state is
  *gapped* (no BEA estimate from it: the worker answers ``resyncing`` from the analytic
  fallback) and the delta waits in a short buffer, because the full snapshot it chains onto may
  still be on its way (periodic full snapshots and deltas travel on different subjects). The
  worker asks the instance for a resync when it holds no state, or when a second delta in a row
  does not apply.
* A delta that libbea refuses (malformed body, inconsistent with the state) leaves the state
  unknown: it is dropped, and the instance is gapped until a full snapshot arrives. A delta whose
  header cannot be read is only counted: if it was one of this instance's deltas, the next delta
  shows the gap.
* A full snapshot clears the gap once no newer delta is known; buffered deltas that chain onto it
  are applied. A resync answer is the publisher's newest state: it clears the gap whatever newer
  state a delta announced. A full snapshot of the very state held checks the state the deltas kept
  (a difference is counted and logged; the full snapshot wins).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any, Protocol

import structlog

from bear import libbea

log = structlog.get_logger("bear.estimator")

PENDING_DELTAS = 64  # deltas held while the state they apply to is on its way
RESYNC_RETRY_S = 0.5  # a gapped instance that stays gapped is asked again at most this often
MAX_CLOCK_SKEW_S = 2.0  # a delta stamped further in the future than this is refused


class DeltaTarget(Protocol):
    """What delta ingest reads and changes of one instance's state (``InstanceState``)."""

    instance: str
    snap: Any  # libbea.Snapshot | None
    gapped: bool
    in_use: int
    lengths: OrderedDict[str, int]
    feed: DeltaFeed

    def ensure_parsed(self) -> bool | None: ...

    def lengths_of(self, ids: Iterable[str]) -> dict[str, int]: ...

    def delta_applied(self, added: list[str], snap_time: float, received: float) -> None: ...

    def event(self, name: str) -> None: ...


class DeltaFeed:
    """The delta side of one instance: deltas waiting for their base, the newest state any delta
    announced, and when a resync was last asked for."""

    __slots__ = ("newest", "pending", "resync_asked", "unfit")

    def __init__(self) -> None:
        self.pending: deque[Any] = deque(maxlen=PENDING_DELTAS)  # libbea.Delta, in arrival order
        self.newest: tuple[int, int] = (-1, -1)  # (generation, seq) of the newest delta seen
        self.unfit = 0  # deltas in a row that did not apply
        self.resync_asked = 0.0  # monotonic; 0: never

    def wants_resync(self, st: DeltaTarget, now: float) -> bool:
        """Whether to ask the instance for a full snapshot now (and note that it was asked)."""
        if not st.gapped or (st.snap is not None and self.unfit < 2):
            return False
        if self.resync_asked and now - self.resync_asked < RESYNC_RETRY_S:
            return False
        self.resync_asked = now
        return True


def offer_delta(st: DeltaTarget, data: bytes, now: float) -> str:
    """Take one ``bear.delta/1`` message for ``st``; what happened: applied, old, gap, malformed,
    unreadable, future, or held (a replay off the event loop reads the snapshot: the delta waits
    until ``release``)."""
    try:
        d = libbea.Delta.from_msgpack(data)
    except ValueError:
        st.event("delta_unreadable")
        return "unreadable"
    if st.in_use:
        st.feed.pending.append(d)
        return "held"
    return _take(st, d, now)


def release(st: DeltaTarget, now: float) -> None:
    """The replays off the loop are done: take the deltas that waited for them."""
    if st.in_use or not st.feed.pending:
        return
    held = list(st.feed.pending)
    st.feed.pending.clear()
    for d in held:
        _take(st, d, now)


def _take(st: DeltaTarget, d: Any, now: float) -> str:
    st.ensure_parsed()  # a full snapshot waiting to be parsed is the base of what follows
    feed = st.feed
    key = (int(d.generation), int(d.seq))
    if key > feed.newest:
        feed.newest = key
    if d.time > now + MAX_CLOCK_SKEW_S:
        st.gapped = True
        st.event("delta_future")
        return "future"
    snap = st.snap
    if snap is not None and d.generation == snap.generation:
        if d.base == snap.seq and d.base_time == snap.time:
            out = _apply(st, d, now)
            if out == "applied":
                catch_up(st, now)
            return out
        if d.seq <= snap.seq:
            st.event("delta_old")
            return "old"
    feed.pending.append(d)
    feed.unfit += 1
    st.gapped = True
    st.event("delta_gap")
    return "gap"


def _apply(st: DeltaTarget, d: Any, now: float) -> str:
    try:
        added = st.snap.apply_delta(d, st.lengths)
        missed = [a for a in added if a not in st.lengths]  # named the engine's way (vLLM): join by dispatch id
        if missed and (known := st.lengths_of(missed)):
            st.snap.set_output_lengths(known)
    except ValueError as exc:
        st.snap = None  # libbea may have changed part of it: the state is unknown
        st.gapped = True
        st.event("delta_malformed")
        log.warning("delta refused; state dropped until a full snapshot", instance=st.instance, error=str(exc))
        return "malformed"
    st.feed.unfit = 0
    st.delta_applied(added, float(d.time), now)
    st.event("delta_applied")
    return "applied"


def catch_up(st: DeltaTarget, now: float) -> None:
    """After a new state (a full snapshot, or a delta): apply the buffered deltas that chain onto
    it, forget the ones it already covers, and clear the gap once no newer delta is known."""
    feed = st.feed
    while feed.pending and st.snap is not None:
        snap = st.snap
        gen, seq = snap.generation, snap.seq
        nxt = None
        for d in feed.pending:
            if d.generation == gen and d.base == seq and d.base_time == snap.time:
                nxt = d
                break
        feed.pending = deque((d for d in feed.pending if d is not nxt and (d.generation != gen or d.seq > seq)),
                             maxlen=PENDING_DELTAS)
        if nxt is None or _apply(st, nxt, now) != "applied":
            break
    snap = st.snap
    if snap is not None and (snap.generation, snap.seq) >= feed.newest:
        st.gapped = False
        feed.unfit = 0
        feed.resync_asked = 0.0  # the next gap may ask at once
        feed.pending.clear()


def resynced(st: DeltaTarget, now: float) -> None:
    """A resync answer was installed: the newest state the publisher sent, so nothing newer is
    known but the buffered deltas that chain onto it (a delta that announced a later state — lost
    since, or forged — must not keep the instance gapped past the answer)."""
    snap = st.snap
    if snap is None:
        return
    st.feed.newest = (int(snap.generation), int(snap.seq))
    catch_up(st, now)


def check_full(st: DeltaTarget, full: Any) -> None:
    """A full snapshot of the state the deltas kept (same generation and seq): compare."""
    held = st.snap
    if held is None or st.gapped or held.generation != full.generation or held.seq != full.seq:
        return
    if st.feed.newest < (0, 0):
        return  # no delta ever applied here: nothing to check
    diff = libbea.snapshot_difference(held, full, compare_time=False)
    if diff is None:
        st.event("mirror_verified")
        return
    st.event("mirror_mismatch")
    log.error("the state kept by deltas differs from the full snapshot; the full snapshot replaces it",
              instance=st.instance, seq=int(full.seq), difference=diff)
