"""``json_line`` (orjson when installed) writes what ``json.dumps(json_safe(x))`` writes."""

from __future__ import annotations

import builtins
import json
import math

import pytest

from bear.protocol.codec import json_line, json_safe

RECORDS = [
    {"a": 1.5, "b": math.inf, "c": float("nan"), "d": (1, 2), "e": {1: "x", "y": [-math.inf, 0.1]}, "h": None},
    {"query_id": "q-é✓", "candidates": {"i1": {"ttft": math.inf, "score": -1e300, "n": 3}}, "ok": True},
    {},
    {"deep": [[[{"k": (1.0, "v")}]]], "big": 2**62, "neg": -7},
]


@pytest.mark.parametrize("rec", RECORDS)
def test_json_line_matches_the_standard_library(rec: dict) -> None:
    line = json_line(rec)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == json.loads(json.dumps(json_safe(rec)))


def test_json_line_without_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_orjson(name: str, *args: object, **kw: object) -> object:
        if name == "orjson":
            raise ImportError(name)
        return real_import(name, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_orjson)
    for rec in RECORDS:
        assert json.loads(json_line(rec)) == json.loads(json.dumps(json_safe(rec)))
