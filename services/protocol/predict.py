"""``bear.predict/1`` → ``bear.prediction/1`` (docs/contract.md §1, docs/predictor.md): the router
asks the predictor, for one prompt and its candidate models, each model's accuracy, output length
and cost. The router builds ``PredictRequest`` and decodes ``Prediction``; the predictor decodes
the request with ``decode_predict`` (its size limits — prompt length, number of models — are the
service's own and stay there). The predictor writes its reply as the equivalent map on its hot
path (``Predictor.predict_wire``: no intermediate objects); ``Prediction`` is the one definition
of what that map must hold (tests/protocol/test_predict.py)."""

from __future__ import annotations

import math
import re
from typing import Annotated

import msgspec
from msgspec import UNSET, UnsetType

from bear.protocol import schemas
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import Message

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class PredictRequest(Message, tag=schemas.PREDICT, kw_only=True, omit_defaults=True):
    """One prompt, its candidate models (predictor names, distinct), and optionally its exact
    token count — one for all models, or per model. (Duplicate models are refused by the
    predictor after its own limit on their number: ``bear.predictor.service.parse_request``.)"""

    prompt: str
    models: Annotated[list[str], msgspec.Meta(min_length=1)]
    deadline: float | None = None  # epoch s; absent: the service's default from now
    id: str | UnsetType = UNSET  # the query's id, echoed in the reply
    prompt_tokens: NonNegInt | dict[str, NonNegInt] | None = None

    def __post_init__(self) -> None:
        if self.deadline is not None and not math.isfinite(self.deadline):
            raise ValueError("deadline must be a finite number (epoch seconds)")

    def tokens_by_model(self) -> dict[str, int] | None:
        """``prompt_tokens`` as a map over ``models`` (None when not given)."""
        pt = self.prompt_tokens
        if pt is None:
            return None
        if isinstance(pt, int):
            return dict.fromkeys(self.models, pt)
        return {k: v for k, v in pt.items() if k in self.models}


class PredictedLength(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    mean: float
    p50: float = math.nan
    p90: float


class PredictedModel(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """One model's answer: P(correct), the output length's distribution (tokens), the prompt's
    tokens with that model's tokenizer, and the expected cost (USD)."""

    acc: float
    len: PredictedLength
    prompt_tokens: int
    cost: float


class Prediction(Message, tag=schemas.PREDICTION, kw_only=True):
    models: dict[str, PredictedModel]
    id: str | UnsetType = UNSET
    # the replica that answered: its NATS identity (``predictor-1``), a claim the router logs with a
    # reply it refuses (bear.router.reply_bounds) — which identity to revoke; absent: not said
    by: str | UnsetType = UNSET


_FIELDS = {
    "prompt": "prompt must be a string",
    "models": "models must be a non-empty list of model names",
    "prompt_tokens": "prompt_tokens must be an int or a map model → int ≥ 0",
    "deadline": "deadline must be a finite number (epoch seconds)",
}
_FIELD = re.compile(r"`\$\.([A-Za-z_]+)|missing required field `([A-Za-z_]+)`")
_REQUEST = msgspec.msgpack.Decoder(PredictRequest)
_REPLY = msgspec.msgpack.Decoder(Prediction)


def decode_predict(data: bytes, *, max_bytes: int) -> PredictRequest:
    """``data`` as a ``PredictRequest``; a coded ``BearError`` otherwise (``too_large`` beyond
    ``max_bytes``, else ``bad_request`` naming the field)."""
    if len(data) > max_bytes:
        raise BearError(ErrorCode.TOO_LARGE, f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        return _REQUEST.decode(data)
    except msgspec.ValidationError as exc:
        detail = str(exc)
        if detail.endswith("`$.v`"):
            raise BearError(ErrorCode.BAD_REQUEST, f"expected v={schemas.PREDICT!r}") from exc
        m = _FIELD.search(detail)
        field = m.group(1) or m.group(2) if m is not None else None
        msg = f"{_FIELDS[field]} ({detail})" if field in _FIELDS else detail
        raise BearError(ErrorCode.BAD_REQUEST, msg) from exc
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BearError(ErrorCode.BAD_REQUEST, f"undecodable request: {type(exc).__name__}") from exc


def decode_prediction(data: bytes) -> Prediction | None:
    """A predictor's reply, or None (an error reply, or not a ``bear.prediction/1``)."""
    try:
        return _REPLY.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
