"""``bear.submit/1``, ``bear.cancel/1`` and ``bear.resend/1`` as typed messages (docs/contract.md §1): what a client
sends a router. The client library builds ``Submit``; the router decodes it once
(``decode_submit``), the struct checking every field's type, range and finiteness — what the
router's hand checks did before (issue 25) — with the same ``bad_request`` messages.

``prompt_ids`` carries a token-id prompt (vLLM's ``prompt: [ids]``) as
``bear.protocol.token_ids`` packs them.

``sampling`` and ``engine`` stay maps here: the router validates them with their own definitions
(``bear.protocol.sampling``, ``bear.protocol.engine_fields``), and ``engine`` is forwarded verbatim."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

import msgspec

from bear.protocol import schemas
from bear.protocol.codec import MAX_MESSAGE_BYTES
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import Message

MAX_ID_CHARS = 256  # query_id, model, session
MAX_NONCE_CHARS = 64
MAX_TOKENS_LIMIT = 2**31  # max_tokens must lie below

ShortText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
Nonce = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NONCE_CHARS)]
NonNegNumber = Annotated[float, msgspec.Meta(ge=0.0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


# how long a router probes a takeover's owner before running the query (``Submit.takeover``): a
# takeover's client waits this much longer for it to start (bear.router.takeover)
TAKEOVER_PROBE_S = 2.0

class Submit(Message, tag=schemas.SUBMIT, kw_only=True, omit_defaults=True):
    """``bear.submit[.<client>]``: one query. Exactly one of ``prompt`` and ``messages``; unset
    numbers take the router's defaults; ``max_tokens_rest``: up to the rest of the chosen engine's
    context, and with ``max_tokens`` at most that many (the output fitted into the context: vLLM
    would refuse a ``max_tokens`` beyond the rest)."""

    query_id: ShortText
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    ttft_target_s: NonNegNumber | None = None
    max_tokens: Annotated[float, msgspec.Meta(ge=1)] | None = None
    max_tokens_rest: bool = False
    lam: NonNegNumber | None = None
    prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    model: ShortText | None = None
    sampling: dict[str, Any] | None = None  # bear.protocol.sampling.Sampling's fields
    engine: dict[str, Any] | None = None  # more engine fields, verbatim (bear.protocol.engine_fields)
    deadline: float | None = None  # epoch s: the client stops waiting for the query to start then
    session: ShortText | None = None
    nonce: Nonce | None = None  # echoed in every message of the answer
    # a token-id prompt (vLLM's ``prompt: [ids]``), packed as bear.protocol.token_ids packs them
    # (a list of ints is accepted too): the engine is sent these ids; ``prompt`` is then their
    # text as far as it is known (the predictor's input; may be ""), and ``model`` is required
    # (ids mean something to one tokenizer only)
    prompt_ids: bytes | list[TokenId] | None = None
    # a resubmission after the router that accepted the query went silent: the chunks of the answer
    # the client holds (0: none). Another router runs it only when that router is gone and no chunk
    # reached the client (else a coded ``incomplete``); never while it lives (bear.router.takeover)
    takeover: Annotated[int, msgspec.Meta(ge=0)] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(_MESSAGES["prompt|messages"])
        if self.prompt_ids is not None:
            if self.prompt is None or self.model is None:
                raise ValueError(_MESSAGES["prompt_ids|model"])
            if isinstance(self.prompt_ids, bytes) and len(self.prompt_ids) % 4:
                raise ValueError(_MESSAGES["prompt_ids"])
        for key in ("ttft_target_s", "max_tokens", "lam"):
            v = getattr(self, key)
            if v is not None and not math.isfinite(v):
                raise ValueError(_MESSAGES[key])
        if self.deadline is not None and not math.isfinite(self.deadline):
            raise ValueError(_MESSAGES["deadline"])
        if self.max_tokens is not None and self.max_tokens >= MAX_TOKENS_LIMIT:
            raise ValueError(_MESSAGES["max_tokens<"])


class Cancel(Message, tag=schemas.CANCEL, kw_only=True):
    """``bear.cancel``: nobody waits for ``query_id``'s answer any more; ``inbox`` is the answer's
    inbox (only whoever holds it may cancel)."""

    query_id: str
    inbox: Annotated[str, msgspec.Meta(min_length=1)]


MAX_RESEND_RANGES = 64  # ranges of chunk seqs in one bear.resend/1
SeqRange = tuple[Annotated[int, msgspec.Meta(ge=0, lt=2**31)], Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]


class Resend(Message, tag=schemas.RESEND, kw_only=True):
    """On ``bear.cancel`` (every router hears it): the chunks of ``query_id``'s answer to
    ``inbox`` whose ``seq`` lies in one of the ``missing`` ranges (``[first, end)``) did not
    arrive — the router that keeps them (``bear.router.client_stream.AnswerKeeper``) publishes
    them to ``inbox`` again. ``nonce`` is the submit's: only the client that holds it is served."""

    query_id: ShortText
    inbox: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    nonce: Nonce
    missing: Annotated[list[SeqRange], msgspec.Meta(min_length=1, max_length=MAX_RESEND_RANGES)]


# The bad_request message of each field (the router's wording before the struct; clients see it).
_MESSAGES: dict[str, str] = {
    "v": f"expected v={schemas.SUBMIT}",
    "query_id": f"query_id must be a non-empty string (≤ {MAX_ID_CHARS} chars)",
    "prompt|messages": "exactly one of prompt or messages is required",
    "prompt": "prompt must be a string",
    "messages": "messages must be a list of maps",
    "ttft_target_s": "ttft_target_s must be a number ≥ 0.0",
    "max_tokens": "max_tokens must be a number ≥ 1",
    "max_tokens<": "max_tokens must be < 2^31",
    "lam": "lam must be a number ≥ 0.0",
    "prompt_tokens": "prompt_tokens must be a non-negative integer",
    "model": f"model must be a non-empty string (≤ {MAX_ID_CHARS} chars)",
    "deadline": "deadline must be a finite number (epoch seconds)",
    "session": f"session must be a non-empty string (≤ {MAX_ID_CHARS} chars)",
    "nonce": f"nonce must be a non-empty string (≤ {MAX_NONCE_CHARS} chars)",
    "max_tokens_rest": "max_tokens_rest must be a boolean",
    "sampling": "sampling must be a map",
    "engine": "engine must be a map",
    "prompt_ids": "prompt_ids must be token ids: packed little-endian uint32 bytes or a list of integers in [0, 2^32)",
    "prompt_ids|model": "prompt_ids needs prompt (their text, may be empty) and model (the ids are one tokenizer's)",
}
_FIELD = re.compile(r"`\$\.([A-Za-z_]+)")
_MISSING = re.compile(r"Object missing required field `([A-Za-z_]+)`")
_SUBMIT = msgspec.msgpack.Decoder(Submit)
_CANCEL = msgspec.msgpack.Decoder(Cancel)
_RESEND = msgspec.msgpack.Decoder(Resend)


def decode_submit(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Submit:
    """``data`` as a ``Submit``; a ``BearError`` otherwise: ``too_large`` beyond ``max_bytes``,
    ``bad_request`` with the offending field's message (msgspec's detail after it)."""
    if len(data) > max_bytes:
        raise BearError(ErrorCode.TOO_LARGE, f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        return _SUBMIT.decode(data)
    except msgspec.ValidationError as exc:
        raise BearError(ErrorCode.BAD_REQUEST, _message(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise BearError(ErrorCode.BAD_REQUEST, f"undecodable msgpack: {exc}"[:300]) from exc
    except RecursionError as exc:
        raise BearError(ErrorCode.BAD_REQUEST, "message nested too deeply") from exc


def _message(detail: str) -> str:
    if detail in _MESSAGES.values():  # a check of __post_init__: its message is the field's own
        return detail
    m = _MISSING.match(detail) or _FIELD.search(detail)
    own = _MESSAGES.get(m.group(1)) if m is not None else None
    if own is None:
        return f"submit: {detail}"
    return own if m is not None and m.re is _MISSING else f"{own} ({detail})"


def decode_cancel(data: bytes) -> Cancel | None:
    """``data`` as a ``Cancel``, or None (malformed cancels are dropped silently: nobody waits
    for an answer to them)."""
    if len(data) > MAX_MESSAGE_BYTES:
        return None
    try:
        return _CANCEL.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def decode_resend(data: bytes) -> Resend | None:
    """``data`` as a ``Resend``, or None (a malformed one, or a ``bear.cancel/1``: dropped silently)."""
    if len(data) > MAX_MESSAGE_BYTES:
        return None
    try:
        return _RESEND.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
