"""The reply stream of a query (docs/router.md, "Protocol"): what a router sends to the client's
inbox — ``Routed`` (again with ``attempt`` 2 after a reroute), ``Chunk``…, then exactly one
``Done`` or ``Error`` — as one msgspec tagged union, ``Reply``, on the ``v`` field. The router
encodes them (``encode_reply``: the same msgpack bytes as the maps it built before, field for
field and in the same order); the client library decodes them (``decode_reply``) and yields them
typed.

Every field has a default, so that a message from an older or newer router still decodes (unknown
fields are ignored); a field whose absence means something is ``UNSET`` when absent and then not
written: ``nonce`` (a submit without one), a chunk's ``text`` or ``choices``, an error's
``instance`` and ``client`` (true: made by the client library, not a router).

``get``/``[]`` read a field by its wire name (``"v"`` the tag), as on the maps these replaced:
for code that inspects messages generically (tests, logs)."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from bear.protocol import schemas
from bear.protocol.by_name import ByName
from bear.protocol.codec import MAX_MESSAGE_BYTES, STRUCT_ENCODER, plain_number
from bear.protocol.errors import ErrorBody, ErrorFields


class Reply(ByName, msgspec.Struct, kw_only=True, tag_field="v", forbid_unknown_fields=False):
    """Base of the reply-stream messages. Each subclass declares ``query_id`` and ``nonce`` last:
    the router added them after a message's own fields, and the wire order stays so."""

    @property
    def v(self) -> str:
        return self.__struct_config__.tag  # type: ignore[return-value]

    @property
    def terminal(self) -> bool:
        return False

    def as_dict(self) -> dict[str, Any]:
        """The message as the map it is on the wire (``v`` included, unset fields left out)."""
        out: dict[str, Any] = msgspec.to_builtins(self, enc_hook=plain_number)
        return out


class Routed(Reply, tag=schemas.ROUTED, kw_only=True):
    """The query was sent to ``instance`` (``attempt`` 2: again, to another, after a failure)."""

    instance: str = ""
    model: str = ""
    predictor_model: str = ""
    predicted_ttft_s: float | None = None
    ttft_method: str = ""
    feasible: bool = False
    policy: str = ""
    decision_s: float = 0.0
    attempt: int = 1
    backend: str = ""
    prompt_tokens: int = 0  # the prompt at that instance
    prompt_tokens_exact: bool = False  # counted by its tokenizer (else estimated from the text)
    query_id: str = ""
    nonce: str | UnsetType = UNSET


class Chunk(Reply, tag=schemas.CHUNK, kw_only=True):
    """One piece of the answer: ``text``, or with engine fields the engine chunk's ``choices``
    verbatim (``text`` then unset). ``seq`` numbers an answer's chunks 0, 1, 2, …: the client
    library yields them in that order and asks for any it missed (``bear.protocol.submit.Resend``)."""

    seq: int = 0
    text: str | UnsetType = UNSET
    choices: list[Any] | UnsetType = UNSET
    query_id: str = ""
    nonce: str | UnsetType = UNSET


class Done(Reply, tag=schemas.DONE, kw_only=True):
    """The answer is complete (terminal): ``chunks`` says how many ``Chunk`` messages it had, so
    that a client can tell a lost last chunk from the end (issue 40)."""

    instance: str = ""
    model: str = ""
    predictor_model: str = ""
    ttft_s: float | None = None
    target_s: float | None = None
    on_time: bool = False
    utility: float | None = None
    predicted_utility: float | None = None
    predicted_ttft_s: float | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    decision_s: float | None = None
    query_id: str = ""
    nonce: str | UnsetType = UNSET
    chunks: int | UnsetType = UNSET  # the answer's Chunk messages (seq 0 … chunks-1); unset: an older router

    @property
    def terminal(self) -> bool:
        return True


class Error(ErrorFields, Reply, tag=schemas.ERROR, kw_only=True):
    """The query failed (terminal): ``error.code`` one of ``ErrorCode``; ``instance`` where it
    failed, when an instance did; ``client``: made by the client library (no router answered,
    the stream went silent, the query was not sent)."""

    error: ErrorBody = msgspec.field(default_factory=ErrorBody)
    instance: str | UnsetType = UNSET
    query_id: str = ""
    nonce: str | UnsetType = UNSET
    client: bool | UnsetType = UNSET

    @property
    def terminal(self) -> bool:
        return True


Event = Routed | Chunk | Done | Error
TERMINAL_TYPES = (Done, Error)


def error_event(code: str, message: str, **fields: Any) -> Error:
    """A ``bear.error/1`` of the stream (``code``: an ``ErrorCode``)."""
    return Error(error=ErrorBody(code=str(code), message=message), **fields)


_DECODER = msgspec.msgpack.Decoder(Event)


def encode_reply(msg: Reply) -> bytes:
    return STRUCT_ENCODER.encode(msg)


def decode_reply(data: bytes) -> Reply | None:
    """A reply-stream message, or None when ``data`` is none (malformed, another schema, over
    the size limit): the client library drops those."""
    if len(data) > MAX_MESSAGE_BYTES:
        return None
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
