"""Replay cases (the format of shared/data/vllm-cpu-traces/cases.jsonl.gz) through libbea.

A case is a snapshot seen at a request's arrival, the request, the true output lengths, the
batch sequence vLLM actually ran until the request's first token, and the engine's TTFT.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bear import libbea
from bear.protocol.jsonl import read_jsonl


def read_cases(path: str | Path) -> Iterator[dict[str, Any]]:
    """Replay cases, one per line (the format of tests/data/vllm-cpu-traces/cases.jsonl.gz)."""
    yield from read_jsonl(path)


@dataclass
class CaseResult:
    request: str
    trace: str
    ttft_s: float
    n_batches: int
    status: str
    batches: list[dict[str, int]] | None
    engine_ttft_s: float | None
    exact: bool | None  # simulated batches == expected_batches (None without --trace)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "request": self.request,
            "ttft_s": self.ttft_s if math.isfinite(self.ttft_s) else None,
            "n_batches": self.n_batches,
        }
        if self.status != "ok":
            d["status"] = self.status
        if self.batches is not None:
            d["batches"] = self.batches
        return d


def replay_case(case: dict[str, Any], beta: list[float] | tuple[float, ...], trace: bool = False) -> CaseResult:
    snap = libbea.Snapshot.from_dict(case["snapshot"])
    res = libbea.estimate(snap, case["request"], beta=list(beta), lengths=case.get("output_lengths") or {}, trace=trace)
    batches = res.get("batches")
    expected = case.get("expected_batches")
    return CaseResult(
        request=str(case["request"].get("id", "")),
        trace=str(case.get("trace", "")),
        ttft_s=float(res["ttft_s"]),
        n_batches=int(res["n_batches"]),
        status=str(res["status"]),
        batches=batches,
        engine_ttft_s=case.get("engine_ttft_s"),
        exact=(batches == expected) if (trace and expected is not None) else None,
    )


def ttft_errors(cases: list[dict[str, Any]], beta: list[float] | tuple[float, ...]) -> tuple[float, float, int]:
    """(MAPE, median relative error, n) of BEA's TTFT against ``engine_ttft_s`` over the cases
    that carry one, with batch-time coefficients ``beta``."""
    rel = []
    for case in cases:
        truth = case.get("engine_ttft_s")
        if not truth:
            continue
        rel.append((replay_case(case, beta).ttft_s - truth) / truth)
    if not rel:
        return math.nan, math.nan, 0
    rel.sort()
    return sum(abs(r) for r in rel) / len(rel), rel[len(rel) // 2], len(rel)
