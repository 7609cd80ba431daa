"""Typed messages of the wire contract (docs/contract.md): one ``msgspec.Struct`` per schema, so
that a message is defined once and decoding validates it in the same step (types, ranges,
finiteness). Every struct carries its schema id in ``v`` (a msgspec tag: written on encode,
optional on decode, refused when it names another schema); unknown fields are ignored, so that a
newer sender can add fields.

Snapshots (``bear.snapshot/1``) are not here: libbea's bounds-checked parser is their one
decoder, and it builds the replay's state directly from the bytes (their field list, for Python
producers and tools and checked against that parser: ``bear.protocol.snapshot``). Schema ids:
``bear.protocol.schemas``.
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from bear.protocol import schemas
from bear.protocol.codec import MAX_MESSAGE_BYTES
from bear.protocol.errors import BearError, ErrorCode

NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
PosInt = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Sequences = Annotated[int, msgspec.Meta(ge=1, le=1024)]  # a query's n (libbea's kMaxSequences)
# An instance id is one NATS subject token (bear.snapshot.<id>; a dot would split it in two, a
# wildcard would match other instances' subjects) and an identity name (bear.runtime.identity).
InstanceId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
Hash64 = Annotated[int, msgspec.Meta(ge=0)]  # a KV block's name, uint64 (msgpack holds no more; bear.prefix.hashing.external)
Seq = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
MAX_PROMPT_TOKEN_IDS = 1 << 20
PackedTokenIds = Annotated[bytes, msgspec.Meta(max_length=4 * MAX_PROMPT_TOKEN_IDS)]

# β used when an instance has no calibration yet: a nominal mid-size model on one modern GPU
# (8 ms per step, 40 µs/token) — a placeholder until the first fit replaces it.
NOMINAL_BETA: tuple[float, float, float, float] = (8e-3, 4e-5, 0.0, 0.0)
# The levels at which a calibration gives its TTFT error distribution (Calibration.ttft_ratio_q).
TTFT_RATIO_LEVELS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
NOMINAL_PROMPT_TOKENS = 512.0  # E[P] of the θ that a β implies when θ itself was never measured


def _finite(*values: float | None) -> None:
    for v in values:
        if v is not None and not math.isfinite(v):
            raise ValueError("numbers must be finite")


class Message(msgspec.Struct, kw_only=True, tag_field="v", forbid_unknown_fields=False):
    """Base of every typed message."""


class Dispatch(Message, tag=schemas.DISPATCH, kw_only=True):
    """``bear.dispatch.<instance>``: the router sent a query there (the estimator queues it ahead
    of later queries until a snapshot shows it, and learns its predicted length)."""

    query_id: str = ""
    request_id: Id
    prompt_tokens: NonNegInt = 0
    predicted_output_tokens: NonNegInt
    max_tokens: PosInt | None = None  # None: the prediction is the cap
    prefix_hit_tokens: NonNegInt = 0  # the hit the estimator found there when the router decided
    t: float
    # the prompt's token ids as the instance's tokenizer encodes them (packed, bear.protocol.token_ids):
    # an estimator replaying that instance's pool block by block keys the request by them
    tokens: PackedTokenIds | None = None
    sequences: Sequences = 1  # the engine's n: sequences it runs side by side (each predicted_output_tokens)
    skip_reading_prefix_cache: bool = False  # prompt logprobs asked: the engine computes the whole prompt

    def __post_init__(self) -> None:
        _finite(self.t)

    def as_replay_request(self) -> dict[str, Any]:
        """The request as the replay queues it ahead of a new query (named as the engine will
        know it, for traces)."""
        pred = max(1, self.predicted_output_tokens)
        r = {"id": self.request_id, "prompt_tokens": max(1, self.prompt_tokens), "max_tokens": self.max_tokens or pred,
             "predicted_output": pred, "prefix_hit_tokens": self.prefix_hit_tokens}
        if self.sequences > 1:
            r["sequences"] = self.sequences
        if self.skip_reading_prefix_cache:
            r["skip_reading_prefix_cache"] = True
        return r


class Calibration(Message, tag=schemas.CALIBRATION, kw_only=True):
    """``bear_calibration`` KV value: eq. 12's β of one instance, θ of eq. 8, and fit quality."""

    instance: str = ""
    beta: tuple[float, float, float, float]
    # the roofline's second line over eq. 12's terms (None: eq. 12 alone): a step takes the larger
    # of β's and γ's time, memory-bound below the kink and compute-bound above (bear.calibrator.fit)
    gamma: tuple[float, float, float, float] | None = None
    mape: float = math.nan
    n: NonNegInt = 0
    theta: float | None = None  # prefill tokens/s; None: not measured
    objective: str = "absolute"  # what the fit minimised (bear.calibrator.fit.OBJECTIVES)
    ttft_mape: float | None = None  # recent BEA TTFT error against observed first tokens (outcomes)
    ttft_bias: float | None = None  # their median relative error (negative: predictions too low)
    ttft_n: NonNegInt = 0
    updated: float = 0.0
    # what made the fit: ``online`` (the calibrator, from the instance's own batch records) or
    # ``profiled`` (a profiling run before serving: ``bear calibrate``, ``bear up``'s sim engines)
    source: Literal["online", "profiled"] = "online"
    # an online refit of a profiled instance: the profile times this factor (how much slower the
    # engine runs now than when profiled: bear.calibrator.fit.rescale_fit_arrays); None: a free fit
    scale: float | None = None
    # an online refit of a profiled instance that is not the rescaled profile (the free fit
    # anchored by it beyond its window: bear.calibrator.fit.anchored_fit_arrays): the profile's
    # coefficients (β, then γ if a roofline), so that a restarted calibrator finds the profile again
    profile: tuple[float, ...] | None = None
    # the router's predicted output lengths there, times this, is what the instance's answers
    # turned out to be (Σ actual / Σ predicted over its recent outcomes: bear.calibrator.lengths);
    # the replay scales the residents' and the dispatches' lengths by it. None: not measured
    length_scale: Annotated[float, msgspec.Meta(gt=0)] | None = None
    # … and σ of log(actual / predicted) around it: the spread the replay draws the residents'
    # lengths with (EstimatorConfig.length_draws; None: to their predictions)
    length_sigma: Annotated[float, msgspec.Meta(ge=0, le=8)] | None = None
    # the instance's recent BEA estimates' error as a distribution: observed / predicted TTFT at
    # each level of TTFT_RATIO_LEVELS (bear.calibrator.ttft_error); what P(on time) is read from
    ttft_ratio_q: tuple[float, ...] | None = None
    # the path around the replayed scheduler (dispatch → engine receipt, engine first token → first
    # byte at the router: HTTP, API server, tokenisation, IPC, relay), fitted from outcomes as
    # path_s0 + path_per_token_s · prompt tokens (bear.calibrator.path); None: not measured
    path_s0: float | None = None
    path_per_token_s: float | None = None
    path_n: NonNegInt = 0

    def __post_init__(self) -> None:
        _finite(*self.beta, *(self.gamma or ()), self.theta, self.updated, self.ttft_mape, self.ttft_bias, self.scale,
                self.length_scale, self.length_sigma, self.path_s0, self.path_per_token_s)
        if any(b < 0 for b in (*self.beta, *(self.gamma or ()))):
            raise ValueError("beta and gamma must be non-negative")
        if self.profile is not None and (len(self.profile) not in (4, 8)
                                         or not all(math.isfinite(b) and b >= 0 for b in self.profile)):
            raise ValueError("profile must be 4 or 8 finite non-negative coefficients")
        if self.theta is not None and self.theta <= 0:
            raise ValueError("theta must be > 0")
        if self.ttft_ratio_q is not None:
            r = self.ttft_ratio_q
            if len(r) != len(TTFT_RATIO_LEVELS) or not all(math.isfinite(x) and x > 0 for x in r) \
                    or any(a > b for a, b in itertools.pairwise(r)):
                raise ValueError(f"ttft_ratio_q must be {len(TTFT_RATIO_LEVELS)} positive, non-decreasing numbers")
        # A model no engine could have: a one-token decode step (context 1k) or a 1k-token prefill
        # predicted below 10 µs or beyond a minute (a β of zeros, a forged or degenerate fit).
        b0, b1, b2, b3 = self.beta
        for t in (b0 + b1 + b2 * 1000.0, b0 + 1000.0 * b1 + b3 * 1000.0 * 1001.0 / 2.0):
            if not 1e-5 <= t <= 60.0:
                raise ValueError(f"beta predicts {t:.3g} s for a plain step: not a plausible engine")

    @property
    def coefficients(self) -> list[float]:
        """What libbea's replay takes: β, then γ when the fit found a roofline."""
        return [*self.beta, *self.gamma] if self.gamma is not None else list(self.beta)

    def path_s(self, prompt_tokens: float) -> float:
        """Seconds the path outside the replay adds to a query of ``prompt_tokens`` here (0: not
        measured); never negative, so an estimate only grows by it."""
        if self.path_s0 is None:
            return 0.0
        return max(0.0, self.path_s0 + (self.path_per_token_s or 0.0) * max(0.0, prompt_tokens))

    def prefill_tps(self) -> float:
        """θ of eq. 8: the measured one, else what β implies for a nominal prompt."""
        return self.theta if self.theta is not None else theta_from_beta(self.beta)


def theta_from_beta(beta: tuple[float, float, float, float], prompt_tokens: float = NOMINAL_PROMPT_TOKENS) -> float:
    """Prefill tokens/s that β implies for one prompt of ``prompt_tokens`` alone in a step:
    P / (β0 + β1·P + β3·P²/2) — the fallback θ of an instance that was never measured."""
    b0, b1, _, b3 = beta
    p = max(prompt_tokens, 1.0)
    per_token = b0 / p + b1 + b3 * p / 2.0
    return 1.0 / per_token if per_token > 0 else math.inf


NOMINAL_CALIBRATION = Calibration(beta=NOMINAL_BETA)


class Prices(msgspec.Struct, kw_only=True):
    input_per_mtok: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    output_per_mtok: Annotated[float, msgspec.Meta(ge=0)] = 0.0

    def __post_init__(self) -> None:
        _finite(self.input_per_mtok, self.output_per_mtok)


class PrefixCacheInfo(msgspec.Struct, kw_only=True):
    """How an instance's prefix cache names its blocks (vLLM's ``--prefix-caching-hash-algo``,
    the ``NONE_HASH`` seed, the block size): what a mirror needs to hash a prompt as that engine
    does. ``events``: the instance publishes its cache on ``bear.kv.<id>``."""

    enabled: bool = True
    block_size: PosInt = 16
    hash_algo: str = "sha256"
    hash_seed: str = "vllm-none-hash"
    events: bool = False


class InstanceRecord(Message, tag=schemas.INSTANCE, kw_only=True):
    """``bear_instances`` KV value: what a router needs to send an instance queries."""

    id: InstanceId
    model: str = ""  # the served model name (the OpenAI ``model`` field)
    base_url: str = ""  # OpenAI base URL, ending in /v1
    gpu: str = ""
    prices: Prices = msgspec.field(default_factory=Prices)
    backend: str = "vllm"  # what serves it (vllm | sim): informational
    predictor_model: str = ""  # the predictor's name of the model; "" → derived from ``model``
    status: str = "up"  # starting | up | down (the engine behind it)
    heartbeat: float = 0.0
    seq: int = -1  # the engine step last published
    generation: int | None = None  # the engine process generation (snapshotter)
    vllm_version: str | None = None
    config: dict[str, int | float | bool | str | None] | None = None  # the engine's scheduler config
    tokenizer: str = ""  # its tokenizer bundle in the bear_tokenizers object store ("": none registered)
    prefix_cache: PrefixCacheInfo | None = None  # None: the instance says nothing of its prefix cache

    def __post_init__(self) -> None:
        _finite(self.heartbeat)


class KvOp(msgspec.Struct, array_like=True):
    """One change of an instance's prefix cache, in the engine's order: blocks ``stored`` (now
    cached), ``removed`` (evicted) or ``cleared`` (the whole cache dropped; no hashes)."""

    kind: Literal["stored", "removed", "cleared"]
    hashes: list[Hash64] = msgspec.field(default_factory=list)


class KvEvents(Message, tag=schemas.KV, kw_only=True):
    """``bear.kv.<instance>``: what one engine step did to the instance's prefix cache (vLLM's
    KV cache events, renamed). ``seq`` counts these messages within one publisher ``epoch``; a
    mirror that misses one asks for the whole state (``KvResync``)."""

    instance: Id
    epoch: Id
    seq: Seq
    t: float
    ops: list[KvOp]

    def __post_init__(self) -> None:
        _finite(self.t)


class KvState(Message, tag=schemas.KV_STATE, kw_only=True):
    """``bear.kv.<instance>``: the whole prefix cache after events message ``seq`` (−1: before the
    first), as the publisher has it: the block names packed as big-endian uint64 (a name appears
    once per cached block that carries it). Large states come in ``parts`` consecutive messages.
    ``complete`` is False when the publisher itself lost engine events it could not recover."""

    instance: Id
    epoch: Id
    seq: Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]
    t: float
    hashes: bytes = b""
    part: NonNegInt = 0
    parts: PosInt = 1
    complete: bool = True

    def __post_init__(self) -> None:
        _finite(self.t)
        if len(self.hashes) % 8:
            raise ValueError("hashes must be whole uint64s (8 bytes each)")
        if self.part >= self.parts:
            raise ValueError("part must be < parts")


class KvResync(Message, tag=schemas.KV_RESYNC, kw_only=True):
    """``bear.kv.resync.<instance>``: a mirror lost the thread; the publisher answers by
    publishing its ``KvState`` on ``bear.kv.<instance>`` (to every mirror)."""

    instance: Id
    reason: str = ""


class Outcome(Message, tag=schemas.OUTCOME, kw_only=True):
    """``bear.outcome.<instance>``: a router finished a query there (observed TTFT and TPOT feed
    every router's view of the instance; the predicted TTFT beside the observed one tells the
    calibrator how good its estimates are)."""

    instance: Id
    ttft_s: float | None = None
    tpot_s: float | None = None
    predicted_ttft_s: float | None = None
    method: str = "none"  # how predicted_ttft_s was made (bea | analytic | router-eq8 | none)
    completed: bool = True
    t: float
    # per sequence: the tokens the answer had and the length the dispatch predicted (None: unknown)
    output_tokens: NonNegInt | None = None
    predicted_output_tokens: NonNegInt | None = None
    # predicted_ttft_s in its parts (None: an older router): the query's time in the router before
    # the estimate, the estimate's engine part (the replay), the path term it added; and the
    # prompt length it was made for — the calibrator fits the path from observed − elapsed − engine
    elapsed_s: float | None = None
    engine_ttft_s: float | None = None
    path_s: float | None = None
    prompt_tokens: NonNegInt | None = None

    def __post_init__(self) -> None:
        _finite(self.ttft_s, self.tpot_s, self.predicted_ttft_s, self.t, self.elapsed_s, self.engine_ttft_s,
                self.path_s)


class ResyncRequest(Message, tag=schemas.RESYNC, kw_only=True):
    """``bear.resync.<instance>``: a consumer's delta chain broke (a lost or malformed delta, a new
    engine generation, a consumer that just started); the instance's publisher answers with its
    newest full ``bear.snapshot/1`` (the state its next delta applies to), or a coded error."""

    instance: str = ""
    consumer: str = ""  # who asks (logs)
    generation: int | None = None  # the state the consumer holds (None: none)
    seq: int | None = None
    reason: str = ""  # gap | malformed | generation | no_state
    deadline: float | None = None


KvMessage = KvEvents | KvState  # what ``bear.kv.<instance>`` carries


MAX_AHEAD = 1024  # dispatches a request may queue ahead per instance
MAX_PARTS = 128  # more queries in one estimate request


class EstimateQuery(msgspec.Struct, kw_only=True):
    id: str = "__query__"
    prompt_tokens: NonNegInt
    max_tokens: PosInt = 1
    priority: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] = 0
    sequences: Sequences = 1  # the engine's n (its siblings queue right behind it)
    skip_reading_prefix_cache: bool = False  # prompt logprobs asked: no prefix-cache hit


class EstimateCandidate(msgspec.Struct, kw_only=True, omit_defaults=True):
    instance: Id
    prefix_hit_tokens: NonNegInt = 0  # a hit the caller knows; the estimator's mirror finds its own when it can
    prompt_tokens: NonNegInt | None = None  # this instance's count (its tokenizer); None: the query's
    tokenizer: str | None = None  # which of the request's ``tokens`` lists is this instance's prompt


class EstimatePart(msgspec.Struct, kw_only=True):
    """One more query estimated in the same request (``EstimateRequest.also``): a burst decided in
    order asks an instance about the next queries in one round trip (bear.router.sequencer)."""

    query: EstimateQuery
    instances: Annotated[list[Id | EstimateCandidate], msgspec.Meta(min_length=1)]
    tokens: dict[Id, PackedTokenIds | Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PROMPT_TOKEN_IDS)]] = (
        msgspec.field(default_factory=dict))
    ahead: dict[Id, Annotated[list[Dispatch], msgspec.Meta(max_length=MAX_AHEAD)]] = msgspec.field(
        default_factory=dict)
    # what is queued ahead of it: "own" its ``ahead``; "request" the request's ``ahead`` (the
    # router's reservations, sent once); "chain" the request's ``ahead``, then the ``then`` of the
    # request and of every earlier "chain" part, in order (a burst's queries before it, each as it
    # would be dispatched) — a chain of n queries costs n dispatches on the wire, not n²/2
    queue: Literal["own", "request", "chain"] = "own"
    then: Dispatch | None = None  # this query as it would be dispatched, queued ahead of the later "chain" parts

    def candidates(self) -> list[EstimateCandidate]:
        return [c if isinstance(c, EstimateCandidate) else EstimateCandidate(instance=c) for c in self.instances]


class EstimateRequest(Message, tag=schemas.ESTIMATE, kw_only=True):
    """``bear.estimate``: the TTFT of one query at each candidate instance."""

    query: EstimateQuery
    instances: Annotated[list[Id | EstimateCandidate], msgspec.Meta(min_length=1)]
    deadline: float | None = None
    # the prompt's token ids per tokenizer id (the router tokenised it once per tokenizer): packed
    # little-endian uint32 (``bear.protocol.token_ids``), or the older list of ints
    tokens: dict[Id, PackedTokenIds | Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PROMPT_TOKEN_IDS)]] = (
        msgspec.field(default_factory=dict))
    # per instance, the caller's dispatches there that the estimator may not hold yet — the
    # router's recent decisions (its reservations) and, for a burst decided in order, the
    # queries before this one it would send there: queued ahead of the query after the ones the
    # estimator knows (a request_id it already holds is its own: skipped) — bear.router.sequencer
    ahead: dict[Id, Annotated[list[Dispatch], msgspec.Meta(max_length=MAX_AHEAD)]] = msgspec.field(
        default_factory=dict)
    # more queries, each estimated as the first is (their rows in ``EstimateReply.also``, in order)
    also: Annotated[list[EstimatePart], msgspec.Meta(max_length=MAX_PARTS)] = msgspec.field(default_factory=list)
    then: Dispatch | None = None  # the query as it would be dispatched: ahead of every "chain" part in ``also``

    def __post_init__(self) -> None:
        for tid, ids in [*self.tokens.items(), *(kv for part in self.also for kv in part.tokens.items())]:
            if isinstance(ids, bytes) and len(ids) % 4:
                raise ValueError(f"tokens[{tid!r}]: packed token ids are 4 bytes each (little-endian uint32); "
                                 f"got {len(ids)} bytes")

    def candidates(self) -> list[EstimateCandidate]:
        return [c if isinstance(c, EstimateCandidate) else EstimateCandidate(instance=c) for c in self.instances]

    def aheads(self) -> list[dict[str, list[Dispatch]]]:
        """What is queued ahead of the query and of each part in ``also`` (``EstimatePart.queue``),
        per instance; raises ValueError past ``MAX_AHEAD`` at an instance."""
        out = [self.ahead]
        thens = [self.then] if self.then is not None else []
        for part in self.also:
            if part.queue == "own":
                ahead = part.ahead
            elif part.queue == "request":
                ahead = self.ahead
            else:
                ahead = {c.instance: [*self.ahead.get(c.instance, ()), *thens] for c in part.candidates()}
                if part.then is not None:
                    thens.append(part.then)
            if any(len(ds) > MAX_AHEAD for ds in ahead.values()):
                raise ValueError(f"at most {MAX_AHEAD} dispatches queued ahead per instance")
            out.append(ahead)
        return out


class EstimateRow(msgspec.Struct, kw_only=True, omit_defaults=False):
    """One instance's answer: the estimate, how it was made, and the load counters it saw."""

    instance: str
    ttft_s: float | None = None
    method: str = "none"  # bea | analytic | none
    status: str = "down"  # ok | stale | no_snapshot | resyncing | overloaded | unschedulable | down | ...
    age_s: float | None = None
    stale: bool = False
    n_batches: int = 0
    n_running: int = 0
    n_waiting: int = 0
    pending_prefill_tokens: int = 0
    pending_decode_tokens: int = 0
    ahead: int = 0  # dispatches queued ahead of the query that the snapshot did not show yet
    tokens: str = "estimated"  # exact: the prompt length came from the instance's tokenizer
    prefix_hit_tokens: int = 0  # the prompt's prefix-cache hit there, handed to the replay
    prefix: str = "none"  # how the hit was found: mirror | off | skipped (prompt logprobs) | unsynced | no_tokens | given | none
    block_size: int = 0  # of the held snapshot's KV cache (0: no snapshot)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # the snapshot describes the pool block by block: a dispatch there should carry the prompt's
    # token ids (Dispatch.tokens), which the replay keys queued requests by; elsewhere they are unused
    pool_keyed: bool = False
    # the β the estimate was made with: ``nominal`` (no calibration of this instance yet: a
    # placeholder, so the estimate may be off by any factor), else the calibration's ``source``
    calibration: str = "nominal"


class EstimateReply(Message, tag=schemas.ESTIMATE_REPLY, kw_only=True):
    query_id: str = ""
    worker: str = ""
    estimates: list[EstimateRow]
    at: float = 0.0  # the worker's clock the estimates are for (snapshot ages are measured to it)
    service_s: float | None = None
    also: list[list[EstimateRow]] = msgspec.field(default_factory=list)  # the rows of EstimateRequest.also


T = TypeVar("T")
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}
_ENCODER = msgspec.msgpack.Encoder()


def decode(kind: type[T], data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> T:
    """``data`` as a ``kind`` message; ``BearError`` (too_large / bad_request, naming the field)
    on anything else."""
    if len(data) > max_bytes:
        raise BearError(ErrorCode.TOO_LARGE, f"message of {len(data)} bytes exceeds {max_bytes}")
    dec = _DECODERS.get(kind)
    if dec is None:
        dec = _DECODERS[kind] = msgspec.msgpack.Decoder(kind)
    try:
        out: T = dec.decode(data)
        return out
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise BearError(ErrorCode.BAD_REQUEST, f"{getattr(kind, '__name__', kind)}: {exc}") from exc


def encode(msg: Any) -> bytes:
    """A message (or any msgpack-able value) as msgpack bytes."""
    return _ENCODER.encode(msg)
