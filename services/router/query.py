"""A client's query as the router holds it: ``bear.submit/1`` decoded once and completed with the
router's defaults, and the two fields admission reads before that parse (the deadline; the ids a
refusal must echo)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bear.protocol.engine_fields import check_engine, check_json, check_streamable, skips_prefix_cache
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.sampling import check_sampling
from bear.protocol.submit import decode_submit
from bear.protocol.token_ids import count, pack, unpack
from bear.router.config import RouterConfig

MAX_PROMPT_BYTES = 4 * 1024 * 1024
REST_UNKNOWN_MAX_TOKENS = 1 << 20  # max_tokens_rest where no candidate registered its context: the estimate's cap
MAX_MESSAGE_DEPTH = 8  # chat messages: role/content maps, content parts, their fields
BYTES_PER_TOKEN = 4  # the text estimate of a prompt's length (docs/contract.md, "Prompt length")


@dataclass
class Query:
    query_id: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    ttft_target_s: float
    max_tokens: int
    lam: float
    prompt_tokens: int | None
    model: str | None = None  # only this model's instances are candidates (served or predictor name)
    sampling: dict[str, Any] = field(default_factory=dict)  # engine sampling fields, validated
    engine: dict[str, Any] = field(default_factory=dict)  # more engine fields, verbatim (bear.protocol.engine_fields)
    trace: dict[str, str] | None = None  # trace-context headers for the calls this query makes
    served_by: str | None = None  # the instance it was last dispatched to
    predicted_output: int | None = None  # the output length (per sequence) its dispatch there announced
    deadline: float | None = None  # the client stops waiting for the start then (epoch s)
    inbox: str = ""  # where the answer goes (a cancel must name it)
    deciding: bool = True  # counted in Admission.deciding until dispatched or finished
    session: str | None = None  # the conversation it belongs to (session-affinity routing)
    # max_tokens_rest: the engine generates up to the rest of its context (vLLM's default), at most
    # ``max_tokens_cap`` when the client gave one; ``max_tokens`` is the largest such output, for the estimate
    rest_of_context: bool = False
    max_tokens_cap: int | None = None
    nonce: str | None = None  # the client's per-query nonce, echoed in every message of the answer
    client: str = ""  # the client identity it came from (its submit subject's token; "": anonymous)
    # a token-id prompt (packed, bear.protocol.token_ids): what the engine is sent; ``prompt`` is
    # then its text as far as the client knew it (the predictor's input), ``prompt_tokens`` its count
    prompt_ids: bytes | None = None
    # the engine request is sent unstreamed (vLLM computes prompt logprobs only so): the answer is
    # one chunk, and its "first token" is the whole answer
    unstreamed: bool = False
    takeover: int | None = None  # a resubmission after its router went silent: the chunks its client holds
    taken_over_from: str | None = None  # the router it was taken over from (bear.router.takeover)

    def max_tokens_at(self, max_model_len: int | None, prompt_tokens: int) -> int | None:
        """The query's output cap at an instance: the client's ``max_tokens``, or with
        ``rest_of_context`` the rest of that instance's context, at most ``max_tokens_cap`` (None:
        its context is unknown and the client gave no cap)."""
        if not self.rest_of_context:
            return self.max_tokens
        rest = max(1, max_model_len - prompt_tokens) if max_model_len else None
        if self.max_tokens_cap is None or rest is None:
            return rest if rest is not None else self.max_tokens_cap
        return min(rest, self.max_tokens_cap)

    def body_max_tokens(self, max_model_len: int | None, prompt_tokens: int, exact: bool) -> int | None:
        """``max_tokens`` of the engine request (None: none sent, the engine's own rest of its
        context). With ``rest_of_context`` and a cap: the cap fitted into the rest where the prompt's
        length there is exact, the cap where it is below the estimated rest, else none (a cap sent
        past the true rest would be refused by vLLM)."""
        if not self.rest_of_context:
            return self.max_tokens
        cap = self.max_tokens_cap
        if cap is None or not max_model_len:
            return cap
        rest = max_model_len - prompt_tokens
        if exact:
            return max(1, min(cap, rest))
        return cap if cap < rest else None

    @property
    def engine_prompt(self) -> str | list[int] | None:
        """The prompt of the engine request: the token ids where the client gave them, else the text."""
        return list(unpack(self.prompt_ids)) if self.prompt_ids is not None else self.prompt

    @property
    def skips_prefix_cache(self) -> bool:
        """The engine computes the whole prompt, whatever it has cached (prompt logprobs)."""
        return skips_prefix_cache(self.engine, chat=self.messages is not None)

    @property
    def text(self) -> str:
        if self.messages is not None:
            return "\n".join(str(m.get("content", "")) for m in self.messages)
        return self.prompt or ""

    def token_estimate(self) -> int:
        """The query's prompt length before any tokenizer (docs/contract.md, "Prompt length"): the
        client's declared ``prompt_tokens``, else the text's UTF-8 bytes / ``BYTES_PER_TOKEN``.
        What the estimate request's query carries and every instance falls back to."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        return max(1, math.ceil(len(self.text.encode()) / BYTES_PER_TOKEN))


def parse_submit(data: bytes, cfg: RouterConfig) -> Query:
    """A ``bear.submit/1`` decoded once (``bear.protocol.submit.Submit`` checks every field) and
    completed with the router's defaults; a coded ``BearError`` for bad input."""
    s = decode_submit(data)
    if s.messages is not None:
        for m in s.messages:
            check_json(m, "messages", MAX_MESSAGE_DEPTH)
    ids = None if s.prompt_ids is None else s.prompt_ids if isinstance(s.prompt_ids, bytes) else pack(s.prompt_ids)
    cap = None if s.max_tokens is None else int(s.max_tokens)
    max_tokens = cap if cap is not None else REST_UNKNOWN_MAX_TOKENS if s.max_tokens_rest else cfg.default_max_tokens
    q = Query(query_id=s.query_id, prompt=s.prompt, messages=s.messages,
              ttft_target_s=cfg.default_ttft_target_s if s.ttft_target_s is None else float(s.ttft_target_s),
              max_tokens=int(max_tokens), lam=cfg.lam if s.lam is None else float(s.lam),
              prompt_tokens=s.prompt_tokens if ids is None else count(ids), model=s.model,
              sampling=check_sampling(s.sampling), prompt_ids=ids,
              engine=check_engine(s.engine), deadline=s.deadline, session=s.session,
              rest_of_context=s.max_tokens_rest, max_tokens_cap=cap if s.max_tokens_rest else None,
              nonce=s.nonce, takeover=s.takeover)
    if len(q.text.encode()) > MAX_PROMPT_BYTES:
        raise BearError(ErrorCode.TOO_LARGE, f"prompt larger than {MAX_PROMPT_BYTES} bytes")
    q.unstreamed = not check_streamable(q.engine, chat=s.messages is not None)
    return q


class _Peek(msgspec.Struct):
    """The fields admission reads before the submit is parsed (cheap: the rest is skipped)."""

    deadline: float | None = None


_peek = msgspec.msgpack.Decoder(_Peek)


class _PeekIds(msgspec.Struct):
    """The ids an answer echoes, read before the submit is parsed (a refusal on arrival, a
    malformed submit): the client library drops messages without its query id and nonce."""

    query_id: Any = None
    nonce: Any = None


_peek_ids = msgspec.msgpack.Decoder(_PeekIds)


def peek_ids(data: bytes) -> tuple[str, str | None]:
    """(query_id, nonce) of a submit as far as they are well-formed ("", None otherwise)."""
    try:
        d = _peek_ids.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return "", None
    qid = d.query_id if isinstance(d.query_id, str) and len(d.query_id) <= 256 else ""
    nonce = d.nonce if isinstance(d.nonce, str) and 0 < len(d.nonce) <= 64 else None
    return qid, nonce


def peek_deadline(data: bytes) -> float | None:
    try:
        d = _peek.decode(data).deadline
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # the full parse answers bad_request
    return d if d is not None and math.isfinite(d) else None
