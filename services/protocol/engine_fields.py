"""Engine fields: the ``engine`` map of ``bear.submit/1`` — request fields of vLLM's OpenAI server
that BEAR's decision does not consume (tools, ``n``, logprobs, structured outputs, chat-template
options …). The router puts them into the chosen engine's request body verbatim and relays the
engine's choices as they come (``bear.chunk/1`` with ``choices``), so an answer keeps every part
vLLM gives it (tool calls, several choices, log-probabilities).

The router reads four of them, because they change the engine's work or the prompt it sees:
``n`` (sequences the engine runs for one query), ``priority`` (its place in a priority-ordered
queue), prompt logprobs (the engine then reads nothing from its prefix cache) and the
chat-template fields (the prompt then is not the one the router can render, so its
length is estimated, not counted). Fields the router owns (``model``, the prompt, the lengths, the
stream and the request id) are refused: the decision decides them. Why each field is where it is:
docs/gateway.md."""

from __future__ import annotations

import math
from typing import Any

from bear.protocol.errors import BearError, ErrorCode

MAX_DEPTH = 16  # JSON schemas of tools and structured outputs nest
MIN_INT, MAX_INT = -(2**63), 2**64 - 1  # what msgpack's integers hold
MAX_N = 128  # sequences per query (vLLM has no bound; each is paid for in the decision's cost)
# set by the router (the decision, the relay) and never taken from a client
OWNED = frozenset({"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream",
                   "stream_options", "request_id"})
# change the prompt the engine renders from the messages: the router's count is then an estimate
TEMPLATE_FIELDS = frozenset({"tools", "documents", "chat_template", "chat_template_kwargs",
                             "continue_final_message", "add_generation_prompt", "add_special_tokens",
                             "truncate_prompt_tokens", "echo"})


def check_json(v: Any, where: str, depth: int) -> None:
    """``v`` is what an engine's JSON body can carry: maps with string keys, lists, strings,
    finite numbers, 64-bit integers, booleans, null, at most ``depth`` levels (a msgpack timestamp
    or bytes would fail only after dispatch, inside the HTTP client; a larger integer already in
    packing the submission)."""
    if depth < 0:
        raise BearError(ErrorCode.BAD_REQUEST, f"{where} nested too deeply")
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise BearError(ErrorCode.BAD_REQUEST, f"{where}: keys must be strings")
            check_json(x, where, depth - 1)
    elif isinstance(v, list):
        for x in v:
            check_json(x, where, depth - 1)
    elif isinstance(v, float):
        if not math.isfinite(v):
            raise BearError(ErrorCode.BAD_REQUEST, f"{where}: numbers must be finite")
    elif isinstance(v, int) and not isinstance(v, bool):
        if not MIN_INT <= v <= MAX_INT:  # msgpack carries 64 bits: a larger one fails to pack
            raise BearError(ErrorCode.BAD_REQUEST, f"{where}: integers must lie in [-2^63, 2^64 - 1]")
    elif not (v is None or isinstance(v, str | int | bool)):
        raise BearError(ErrorCode.BAD_REQUEST, f"{where}: {type(v).__name__} values are not JSON")


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BearError(ErrorCode.BAD_REQUEST, f"engine.{name} must be an integer in [{lo}, {hi}]")
    return v


def check_engine(raw: Any) -> dict[str, Any]:
    """The validated ``engine`` map of a submission (``{}`` when absent); a ``bad_request``
    BearError naming the field otherwise."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BearError(ErrorCode.BAD_REQUEST, "engine must be a map")
    for k, v in raw.items():
        if not isinstance(k, str) or not k or len(k) > 64:
            raise BearError(ErrorCode.BAD_REQUEST, "engine: field names must be strings of 1-64 characters")
        if k in OWNED:
            raise BearError(ErrorCode.BAD_REQUEST, f"engine.{k} is set by the router, not by the query")
        check_json(v, f"engine.{k}", MAX_DEPTH)
    if "n" in raw and raw["n"] is not None:
        _int(raw["n"], "n", 1, MAX_N)
    if "priority" in raw and raw["priority"] is not None:
        _int(raw["priority"], "priority", -(2**31), 2**31 - 1)
    return {k: v for k, v in raw.items() if v is not None}


def sequences(engine: dict[str, Any]) -> int:
    """How many sequences the engine runs for the query (``n``)."""
    return int(engine.get("n") or 1)


def priority(engine: dict[str, Any]) -> int:
    """The query's priority in a priority-ordered engine queue (vLLM: lower first; 0 by default)."""
    return int(engine.get("priority") or 0)


def prompt_logprobs(engine: dict[str, Any], chat: bool) -> Any:
    """The prompt logprobs vLLM computes for the request (None: none): ``prompt_logprobs``, else
    with ``echo`` (chat) ``top_logprobs``, which defaults to 0, or (completions) ``logprobs``."""
    if engine.get("prompt_logprobs") is not None:
        return engine["prompt_logprobs"]
    if not engine.get("echo"):
        return None
    return engine.get("top_logprobs", 0) if chat else engine.get("logprobs")


def needs_unstreamed(engine: dict[str, Any], chat: bool) -> bool:
    """Whether vLLM serves the request only unstreamed: prompt logprobs other than 0 ("`prompt_logprobs`
    are not available when `stream=True`")."""
    n = prompt_logprobs(engine, chat)
    return isinstance(n, int) and not isinstance(n, bool) and (n > 0 or n == -1)


def check_streamable(engine: dict[str, Any], chat: bool) -> bool:
    """Whether the engine request can be streamed (True), or is sent unstreamed (False: a
    completion asking for prompt logprobs, which vLLM computes only so; its answer then comes as
    one chunk). A chat request asking for them is refused — a chat completion's prompt logprobs
    lie outside its choices, where the relay carries nothing — before a decision, in words that
    name the field the client set."""
    if not needs_unstreamed(engine, chat):
        return True
    if not chat:
        return False
    why = "prompt_logprobs" if engine.get("prompt_logprobs") is not None else "echo with top_logprobs"
    raise BearError(ErrorCode.BAD_REQUEST, f"{why} asks for prompt logprobs, which BEAR serves on completions "
                                           "(/v1/completions, unstreamed) only; use prompt_logprobs 0 or leave "
                                           "them out")


def skips_prefix_cache(engine: dict[str, Any], chat: bool) -> bool:
    """Whether the engine computes the whole prompt, whatever its prefix cache holds: vLLM sets
    ``skip_reading_prefix_cache`` when the request asks for prompt logprobs (even 0 of them)."""
    return prompt_logprobs(engine, chat) is not None


def renders_own_prompt(engine: dict[str, Any]) -> bool:
    """Whether the engine's prompt differs from the one rendered from the messages alone."""
    return any(f in engine for f in TEMPLATE_FIELDS)
