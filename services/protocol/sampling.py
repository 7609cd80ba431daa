"""Sampling parameters a query carries to the engine: the ``sampling`` map of ``bear.submit/1``.

One definition serves both ends: the router validates the map with it before putting the fields
into the engine's request body, and the gateway's OpenAI request types inherit it, so a field the
gateway accepts is exactly a field the router forwards. Only fields that change how tokens are
drawn are here (vLLM honours all of them; the sim engine ignores them): anything that changes the
shape of the answer (``n``, logprobs, tools) is not, because the router streams one text."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from bear.protocol.errors import BearError, ErrorCode

MAX_STOP = 16  # stop strings (OpenAI allows 4; vLLM any number)
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024

Stop = str | Annotated[list[Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]], msgspec.Meta(max_length=MAX_STOP)]


class Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The engine-side sampling fields (OpenAI names, vLLM extensions marked). ``None``: the engine's default."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # vLLM
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None  # vLLM
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] | None = None  # vLLM
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_STOP)] | None = None  # vLLM
    logit_bias: Annotated[dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]],
                          msgspec.Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None  # vLLM
    ignore_eos: bool | None = None  # vLLM

    def __post_init__(self) -> None:
        if self.logit_bias is not None and not all(k.isdigit() for k in self.logit_bias):
            raise ValueError("logit_bias keys must be token ids (decimal strings)")


SAMPLING_FIELDS: tuple[str, ...] = Sampling.__struct_fields__


def sampling_of(obj: Sampling) -> dict[str, Any]:
    """The fields of ``obj`` (or of a struct that inherits ``Sampling``) that are set."""
    return {f: v for f in SAMPLING_FIELDS if (v := getattr(obj, f)) is not None}


def check_sampling(raw: Any) -> dict[str, Any]:
    """The validated ``sampling`` map of a submission (unset fields dropped); a ``bad_request``
    BearError naming the field otherwise."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BearError(ErrorCode.BAD_REQUEST, "sampling must be a map")
    try:
        return sampling_of(msgspec.convert(raw, Sampling))
    except msgspec.ValidationError as exc:
        raise BearError(ErrorCode.BAD_REQUEST, f"sampling: {exc}") from exc
