"""Decisions that see each other: a router decides its queries one at a time, in the order they
were ready, each on estimates that include every dispatch it decided before — however many
queries arrive at once.

Without it a burst herds: 200 queries submitted together were all estimated on the same view
(the last snapshot plus the dispatches already published), each found the best instance free,
and all went there. The sequencer keeps the decisions in order and the estimates honest at
little cost, with three facts:

* **Reservations** (``Reservations``): every dispatch this router made in the last ``keep_s`` is
  sent with every estimate (``EstimateRequest.ahead``), so an estimate includes it whether or not
  the estimator has heard ``bear.dispatch`` yet (it skips those it holds). Each instance keeps a
  log of the queries committed there: the *version* an estimate was asked at is the log's length.
* **Exact or a lower bound.** An estimate asked at version v that assumed the queries ``assumed``
  would be dispatched there first is *exact* when the log since v is exactly ``assumed``, and a
  *lower bound* when ``assumed`` is empty (a dispatch queued ahead never makes a first token come
  sooner). A policy that is monotone in the estimates (the BEAR rule: a higher TTFT can only make
  an instance infeasible) that picks an instance whose estimate is exact makes the decision it
  would make on exact estimates everywhere — the others' true values are at least their lower
  bounds, which lost already. So the decision commits at once in the common case; only when it
  picks an instance whose estimate is not exact is that instance asked again.
* **Chains.** The fresh ask at instance i covers the query and the next ``chain`` waiting queries
  that may go there, twice each: assuming every query before it in the chain goes to i (exact
  while the burst keeps choosing i) and assuming none does (a lower bound tight to now). A herd
  of 200 then costs one round trip per ``chain`` queries, not one per query.

A policy that is not monotone (``Policy.monotone`` False) has every estimate that is not exact
asked again before it decides. Across routers nothing is shared but NATS: a decision sees another
router's dispatch once the estimator has heard it (one NATS hop; ``bear bench burst`` measures
it), so two routers' bursts can overlap by what each decides within that time.

The live router (``bear.router.service``) and the tests drive the same ``Sequencer``; it owns no
I/O but the callables each ``Pending`` brings.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bear.protocol.messages import Dispatch, EstimatePart, EstimateReply, EstimateRow

CHAIN = 8  # waiting queries a fresh ask covers after the one deciding
KEEP_S = 0.25  # a reservation is sent with estimates this long (the estimator hears dispatches in ~1 ms)
MAX_RESERVED = 256  # per instance
MAX_LOG = 4096  # commits remembered per instance (estimates older than that are lower bounds only)
MAX_ASKS = 4  # fresh asks per decision at most (then it commits on what it has)


@dataclass
class Reservations:
    """This router's recent dispatches per instance, and the log of queries committed there."""

    keep_s: float = KEEP_S
    max_per_instance: int = MAX_RESERVED
    _recent: dict[str, deque[Dispatch]] = field(default_factory=dict)
    _log: dict[str, list[str]] = field(default_factory=dict)
    _base: dict[str, int] = field(default_factory=dict)  # commits dropped from the front of each log

    def version(self, instance: str) -> int:
        """Commits at ``instance`` so far."""
        return self._base.get(instance, 0) + len(self._log.get(instance, ()))

    def versions(self, instances: Iterable[str]) -> dict[str, int]:
        return {i: self.version(i) for i in instances}

    def since(self, instance: str, version: int) -> list[str] | None:
        """The queries committed at ``instance`` since ``version`` (None: forgotten)."""
        base = self._base.get(instance, 0)
        if version < base:
            return None
        return self._log.get(instance, [])[version - base:]

    def add(self, instance: str, d: Dispatch) -> None:
        """A dispatch just published: reserved for ``keep_s`` and logged."""
        q = self._recent.setdefault(instance, deque())
        q.append(msgspec.structs.replace(d, tokens=None))  # the estimator keys it by counts if it lacks the real one
        while len(q) > self.max_per_instance:
            q.popleft()
        log = self._log.setdefault(instance, [])
        log.append(d.query_id or d.request_id)
        if len(log) > MAX_LOG:
            drop = len(log) - MAX_LOG // 2
            del log[:drop]
            self._base[instance] = self._base.get(instance, 0) + drop

    def at(self, instances: Iterable[str], now: float) -> dict[str, list[Dispatch]]:
        """The reservations to send with an estimate at ``instances`` (those younger than ``keep_s``)."""
        out: dict[str, list[Dispatch]] = {}
        for i in instances:
            q = self._recent.get(i)
            if not q:
                continue
            while q and q[0].t < now - self.keep_s:
                q.popleft()
            if q:
                out[i] = list(q)
        return out


@dataclass(frozen=True)
class Estimated:
    """One estimate at one instance, and what it assumed."""

    row: EstimateRow
    version: int  # the instance's commits when it was asked
    assumed: tuple[str, ...] = ()  # queries it assumed dispatched there, in order, after those
    elapsed_s: float = 0.0  # how long the query had been in the router when it was asked


# (instances, ahead per instance) → the reply (None: no answer in time)
AskFn = Callable[[list[str], dict[str, list[Dispatch]]], Awaitable[EstimateReply | None]]
# (instance, one part per query) → the reply, the first part's rows in ``estimates``, the rest in ``also``
AskPartsFn = Callable[[str, list[EstimatePart]], Awaitable[EstimateReply | None]]


@dataclass
class Pending:
    """One query waiting for its decision: its estimates so far and how to act on them.

    ``decide(rows, elapsed)``: the decision on those rows (pure; what ``bear.router.decide`` returns,
    with anything the caller wants back) and the chosen instance (None: refused, nothing to commit);
    ``hypothetical(i)``: the dispatch it would make at i (a chain queues it ahead of the queries after
    it); ``ask``: estimates at some instances with dispatches queued ahead; ``commit(result)``: publish
    the dispatch (awaited before the next decision starts)."""

    query_id: str
    instances: list[str]
    decide: Callable[[dict[str, EstimateRow], dict[str, float]], tuple[Any, str | None]]
    hypothetical: Callable[[str], Dispatch]
    ask: AskFn
    commit: Callable[[Any], Awaitable[None]]
    t0: float  # perf_counter at submit (elapsed times are measured from it)
    # (instances, ahead) → the query as one part of a request (a chain asks many in one round trip)
    part: Callable[[list[str], dict[str, list[Dispatch]]], EstimatePart] | None = None
    estimates: dict[str, list[Estimated]] = field(default_factory=dict)
    asks: int = 0  # fresh asks made for it
    future: asyncio.Future[Any] | None = None
    cancelled: bool = False  # its caller gave up: decided, never committed

    def add(self, instance: str, e: Estimated) -> None:
        self.estimates.setdefault(instance, []).append(e)

    def add_reply(self, reply: EstimateReply | None, versions: Mapping[str, int], elapsed_s: float,
                  assumed: Mapping[str, tuple[str, ...]] | None = None) -> None:
        if reply is None:
            return
        for row in reply.estimates:
            if row.instance in versions:
                self.add(row.instance, Estimated(row, versions[row.instance], (assumed or {}).get(row.instance, ()),
                                                 elapsed_s))


@dataclass
class Ask:
    """One query's estimate in an ask: at ``instances``, with ``ahead`` queued there first, which
    assumed the queries ``assumed`` dispatched there. In one request (``ask_parts``) ``queue`` says
    how the estimator rebuilds ``ahead`` from what the request already carries
    (``EstimatePart.queue``) and ``then`` is the query as it would be dispatched (the chain's next
    queries queue behind it)."""

    q: Pending
    instances: list[str]
    ahead: dict[str, list[Dispatch]]
    assumed: dict[str, tuple[str, ...]]
    queue: str = "own"  # own | request | chain
    then: Dispatch | None = None


def _exact(e: Estimated, res: Reservations, instance: str) -> bool:
    if e.row.method != "bea":  # the analytic fallback reads no queue ahead: a fresh ask changes nothing
        return True
    since = res.since(instance, e.version)
    return since is not None and tuple(since) == e.assumed


def _upper(e: Estimated, res: Reservations, instance: str) -> bool:
    """Whether ``e`` is an upper bound: every query committed at ``instance`` since it was asked
    is one it assumed, in its order (it queued those and more ahead: a dispatch fewer never makes
    the first token later)."""
    if e.row.method != "bea" or e.row.ttft_s is None:
        return False
    since = res.since(instance, e.version)
    if since is None:
        return False
    rest = iter(e.assumed)
    return all(any(q == a for a in rest) for q in since)


def best(p: Pending, res: Reservations) -> tuple[dict[str, EstimateRow], dict[str, float], dict[str, bool]]:
    """Per instance the estimate to decide on — an exact one if there is, else the tightest lower
    bound (the newest that assumed nothing) — its elapsed time, and whether it is exact."""
    rows: dict[str, EstimateRow] = {}
    elapsed: dict[str, float] = {}
    exact: dict[str, bool] = {}
    for i, es in p.estimates.items():
        pick = next((e for e in reversed(es) if _exact(e, res, i)), None)
        if pick is None:
            lows = [e for e in es if not e.assumed]
            if not lows:
                continue
            pick = max(lows, key=lambda e: e.version)
        rows[i], elapsed[i], exact[i] = pick.row, pick.elapsed_s, _exact(pick, res, i)
    return rows, elapsed, exact


def upper_bound(p: Pending, res: Reservations, instance: str) -> Estimated | None:
    """The tightest upper bound on ``p``'s estimate at ``instance`` (None: none holds)."""
    ups = [e for e in p.estimates.get(instance, ()) if _upper(e, res, instance)]
    return min(ups, key=lambda e: e.row.ttft_s or 0.0) if ups else None


class Sequencer:
    """Decides ``Pending`` queries one at a time, in the order they were handed over."""

    def __init__(self, reservations: Reservations | None = None, *, monotone: bool = True, chain: int = CHAIN,
                 max_asks: int = MAX_ASKS, clock: Callable[[], float] = time.perf_counter,
                 ask_parts: AskPartsFn | None = None) -> None:
        """``ask_parts``: asks a chain's queries at one instance in one request (None: one request each)."""
        self.res = reservations or Reservations()
        self.ask_parts = ask_parts
        self.monotone = monotone
        self.chain = max(0, chain)
        self.max_asks = max(0, max_asks)
        self.clock = clock
        self._waiting: deque[Pending] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.decided = 0
        self.asks = 0  # fresh asks made (round trips to the estimator beyond each query's first)
        self.committed_exact = 0  # decisions committed on an exact estimate at the chosen instance
        self.committed_bounded = 0  # decisions an upper bound at the chosen instance settled without an ask
        self.prefetches = 0  # chains asked ahead, in the background, while a burst kept choosing an instance
        self._chain_end: dict[str, Pending] = {}  # per instance, the last query the newest chain there covers
        self._prefetching: dict[str, tuple[asyncio.Task[None], set[int]]] = {}  # instance → (ask, ids of queries)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for task, _ in list(self._prefetching.values()):
            task.cancel()
        for p in self._waiting:
            if p.future is not None and not p.future.done():
                p.future.cancel()
        self._waiting.clear()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def decide(self, p: Pending) -> Any:
        """``p``'s decision result (what its ``decide`` returned), once committed."""
        self.start()
        p.future = asyncio.get_running_loop().create_future()
        self._waiting.append(p)
        self._wake.set()
        try:
            return await asyncio.shield(p.future)
        except asyncio.CancelledError:
            p.cancelled = True
            if p in self._waiting and p is not self._waiting[0]:  # not started: never decided
                self._waiting.remove(p)
            raise

    async def _run(self) -> None:
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            p = self._waiting[0]
            try:
                result = await self._one(p)
            except Exception as exc:  # the query's own failure (its callables): its caller sees it
                self._waiting.popleft()
                if p.future is not None and not p.future.done():
                    p.future.set_exception(exc)
                continue
            self._waiting.popleft()
            self.decided += 1
            if p.future is not None and not p.future.done():
                p.future.set_result(result)

    async def _one(self, p: Pending) -> Any:
        while True:
            rows, elapsed, exact = best(p, self.res)
            result, chosen = p.decide(rows, elapsed)
            if chosen is None:
                return result
            stale = [i for i in rows if not exact[i]] if not self.monotone else (
                [chosen] if chosen in exact and not exact[chosen] else [])
            if p.cancelled:
                return result
            if stale and self.monotone:
                bounded = self._within_bounds(p, rows, elapsed, chosen)
                if bounded is not None:
                    result, stale = bounded, []
                    self.committed_bounded += 1
            if not stale or p.asks >= self.max_asks:
                if exact.get(chosen):
                    self.committed_exact += 1
                await p.commit(result)
                if self.monotone:
                    self._prefetch_after(chosen)
                return result
            ahead_of_us = self._prefetching.get(chosen)
            if len(stale) == 1 and ahead_of_us is not None and id(p) in ahead_of_us[1]:
                await asyncio.shield(ahead_of_us[0])  # a chain already asked covers it: wait for that
                continue
            await self._ask_again(p, stale)

    def _within_bounds(self, p: Pending, rows: dict[str, EstimateRow], elapsed: dict[str, float],
                       chosen: str) -> Any | None:
        """The decision when bounds settle it without a fresh ask (None: they do not): ``chosen``
        won on lower bounds; if it still wins with its own estimate raised to an upper bound, a
        monotone policy picks it on the exact estimates too — the others' true values are at
        least the lower bounds that lost, chosen's at most the bound it won with. The result
        carries that bound (the TTFT it reports errs late, never early)."""
        up = upper_bound(p, self.res, chosen)
        if up is None:
            return None
        result, again = p.decide({**rows, chosen: up.row}, {**elapsed, chosen: up.elapsed_s})
        return result if again == chosen else None

    async def _ask_again(self, p: Pending, instances: list[str]) -> None:
        """Fresh estimates for ``p`` at ``instances``; at one instance (the monotone case) also a
        chain over the next waiting queries that may go there."""
        p.asks += 1
        self.asks += 1
        if len(instances) == 1 and self.chain:
            i = instances[0]
            chain = [p, *[w for w in list(self._waiting)[1:] if i in w.instances][:self.chain]]
            self._chain_end[i] = chain[-1]
            await self._send(i, self._chain_asks(chain, i))
            return
        versions = self.res.versions(instances)
        reserved = self.res.at(instances, time.time())
        await self._ask(p, instances, reserved, versions, {})

    def _chain_asks(self, chain: list[Pending], i: str) -> tuple[list[Ask], dict[str, int]]:
        """The asks of a chain at ``i`` as of now: each query assuming every one before it in the
        chain goes to i (exact while they do) and assuming none does (the tightest lower bound)."""
        versions = self.res.versions([i])
        reserved = self.res.at([i], time.time())
        ahead = list(reserved.get(i, []))
        assumed: list[str] = []
        thens = [q.hypothetical(i) for q in chain]
        asks: list[Ask] = [Ask(chain[0], [i], reserved, {}, then=thens[0])]
        for k, nxt in enumerate(chain[1:], start=1):
            ahead.append(thens[k - 1])
            assumed.append(chain[k - 1].query_id)
            asks.append(Ask(nxt, [i], {i: list(ahead)}, {i: tuple(assumed)}, "chain", thens[k]))
            asks.append(Ask(nxt, [i], reserved, {}, "request"))
        return asks, versions

    async def _send(self, i: str, planned: tuple[list[Ask], dict[str, int]]) -> None:
        asks, versions = planned
        if not asks:
            return
        if self.ask_parts is not None and len(asks) > 1 and all(a.q.part is not None for a in asks):
            await self._ask_in_one(i, asks, versions)
            return
        await asyncio.gather(*(self._ask(a.q, a.instances, a.ahead, versions, a.assumed) for a in asks))

    def _prefetch_after(self, i: str) -> None:
        """After a commit at ``i``: when the queries waiting that the last chain there covers run
        short (half a chain), ask the next chain now, in the background — the burst goes on
        choosing i while the round trip is in flight (the asks are exact or not by what they
        assumed, so a prefetch is never wrong, at worst wasted)."""
        if not self.chain or i in self._prefetching:
            return
        nxt = [w for w in list(self._waiting)[1:] if i in w.instances][:self.chain]
        end = self._chain_end.get(i)
        covered = next((k + 1 for k, w in enumerate(nxt) if w is end), 0)
        if covered > self.chain // 2 or covered >= len(nxt):
            return
        self._chain_end[i] = nxt[-1]
        self.prefetches += 1
        task = asyncio.create_task(self._send(i, self._chain_asks(nxt, i)))
        self._prefetching[i] = (task, {id(w) for w in nxt[covered:]})
        task.add_done_callback(lambda _t: self._prefetching.pop(i, None))

    async def _ask_in_one(self, instance: str, asks: list[Ask], versions: Mapping[str, int]) -> None:
        """A chain's asks at one instance in one request (one round trip, one worker turn): the
        reservations once, each query's dispatch once (``EstimatePart.queue``)."""
        assert self.ask_parts is not None
        parts = []
        for a in asks:
            own = a.queue == "own"
            part = a.q.part(a.instances, {i: ds for i, ds in a.ahead.items() if i in a.instances} if own else {})  # type: ignore[misc]
            parts.append(msgspec.structs.replace(part, queue=a.queue, then=a.then) if a.queue != "own" or a.then
                         else part)
        sent = {id(a.q): self.clock() - a.q.t0 for a in asks}
        try:
            reply = await self.ask_parts(instance, parts)
        except Exception:  # no answer: decide on what it has
            return
        if reply is None:
            return
        for a, rows in zip(asks, [reply.estimates, *reply.also], strict=False):
            a.q.add_reply(EstimateReply(estimates=rows), {i: versions[i] for i in a.instances}, sent[id(a.q)],
                          a.assumed)

    async def _ask(self, p: Pending, instances: list[str], ahead: dict[str, list[Dispatch]],
                   versions: Mapping[str, int], assumed: Mapping[str, tuple[str, ...]]) -> None:
        elapsed = self.clock() - p.t0
        try:
            reply = await p.ask(instances, {i: ds for i, ds in ahead.items() if i in instances})
        except Exception:  # no answer: decide on what it has
            return
        p.add_reply(reply, {i: versions[i] for i in instances}, elapsed, assumed)

