"""The request ids an engine gives the router's requests, and back: vLLM's OpenAI server names a
request ``chatcmpl-<X-Request-Id>`` (chat) or ``cmpl-<X-Request-Id>-<prompt index>``
(completions), its engine appends ``-<8 random hex>`` to keep ids unique, and ``n > 1`` runs as
child requests ``<k>_<that id>`` (vllm/v1/engine/input_processor.py ``assign_request_id``,
parallel_sampling.py ``get_child_info``). Snapshots name requests the engine's way, the router's
``bear.dispatch`` names them by the X-Request-Id it sent: the estimator joins the two through
``dispatch_id``, and the sim engine names its requests with ``engine_id`` so that every test on
it crosses the same join."""

from __future__ import annotations

import hashlib
import re

# greedy groups: the X-Request-Id may itself hold dashes and digits
_ENGINE_ID = re.compile(r"(?:\d+_)?(?:chatcmpl-(?P<chat>.+)|cmpl-(?P<text>.+)-\d+)-[0-9a-f]{8}")


def dispatch_id(engine_id: str) -> str:
    """The X-Request-Id inside a vLLM engine request id (module doc); any other id is itself
    (an engine that keeps the caller's id, ``bear eval``'s simulated instances)."""
    if not engine_id.startswith(("c", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9")):
        return engine_id  # the common non-vLLM case without a regex
    m = _ENGINE_ID.fullmatch(engine_id)
    if m is None:
        return engine_id
    return m.group("chat") or m.group("text")


def engine_id(request_id: str, chat: bool, child: int | None = None) -> str:
    """The id vLLM's engine gives the request sent with X-Request-Id ``request_id``: the random
    suffix drawn from the id itself, so a seeded sim run is repeatable; ``child``: its k-th
    sequence when ``n > 1``."""
    suffix = hashlib.blake2b(request_id.encode(), digest_size=4).hexdigest()
    base = f"chatcmpl-{request_id}-{suffix}" if chat else f"cmpl-{request_id}-0-{suffix}"
    return base if child is None else f"{child}_{base}"
