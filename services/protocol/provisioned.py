"""What an instance was provisioned with: the ``bear_provisioned`` KV bucket (issue 26).

An instance's identity may write only its own ``bear_instances`` key — but what it writes there
is its own word, so a leaked instance credential could re-register the instance under another
model, at price 0, at an attacker's address (and the routers would send it prompts and the
engine's API key). ``bear up`` and ``bear nats provision`` (as ``admin``, the only identity that
may write this bucket) bind each instance id to its served model, predictor model, base URL,
prices and context; with provisioning on, a router takes a registry entry only when it agrees
with its binding (``mismatch``), and none for an id that has none (``unprovisioned``).

The value is a ``bear.provisioned/1`` message (msgpack, like every registry value)."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from bear.protocol import schemas
from bear.protocol.messages import InstanceId, InstanceRecord, Message, Prices

SCHEMA = schemas.PROVISIONED


class Provisioned(Message, tag=SCHEMA, kw_only=True):
    """One instance's binding. ``predictor_model`` "": derived from ``model`` (as the registry
    derives it); ``max_model_len`` None: its context is not bound."""

    id: InstanceId
    model: str
    base_url: str
    prices: Prices = msgspec.field(default_factory=Prices)
    predictor_model: str = ""
    max_model_len: int | None = None


def provisioned(instance: str, model: str, base_url: str, price_input_per_mtok: float = 0.0,
                price_output_per_mtok: float = 0.0, *, predictor_model: str = "",
                max_model_len: int | None = None) -> Provisioned:
    return Provisioned(id=instance, model=model, base_url=base_url.rstrip("/"), predictor_model=predictor_model,
                       prices=Prices(input_per_mtok=price_input_per_mtok, output_per_mtok=price_output_per_mtok),
                       max_model_len=max_model_len)


def _same_price(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def mismatch(p: Provisioned, rec: InstanceRecord, predictor_of: Any = None) -> str:
    """"" when ``rec`` (a registry entry) agrees with its binding ``p``, else the first field that
    differs, as ``field: registered != provisioned``. ``predictor_of(model)``: the predictor name
    a served model gets when the entry names none (the router's aliases)."""
    derive = predictor_of or (lambda m: m.rsplit("/", 1)[-1])
    checks: list[tuple[str, Any, Any, bool]] = [
        ("model", rec.model, p.model, rec.model == p.model),
        ("base_url", rec.base_url.rstrip("/"), p.base_url.rstrip("/"), rec.base_url.rstrip("/") == p.base_url.rstrip("/")),
        ("price_input", rec.prices.input_per_mtok, p.prices.input_per_mtok,
         _same_price(rec.prices.input_per_mtok, p.prices.input_per_mtok)),
        ("price_output", rec.prices.output_per_mtok, p.prices.output_per_mtok,
         _same_price(rec.prices.output_per_mtok, p.prices.output_per_mtok)),
    ]
    got_pm, want_pm = rec.predictor_model or derive(rec.model), p.predictor_model or derive(p.model)
    checks.append(("predictor_model", got_pm, want_pm, got_pm == want_pm))
    if p.max_model_len is not None:
        mml = (rec.config or {}).get("max_model_len")
        checks.append(("max_model_len", mml, p.max_model_len, mml == p.max_model_len))
    for name, got, want, ok in checks:
        if not ok:
            return f"{name}: registered {got!r} != provisioned {want!r}"
    return ""
