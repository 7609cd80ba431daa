"""The live TTFT error by source, from a router's outcome log (``bear diagnose-live``).

Why: ``bear eval --experiment decomposition`` splits the error in virtual time; live, the router
knows more parts than the estimate does. Each ``done`` record whose chosen candidate was a BEA
estimate splits its observed TTFT (submit → first token at the router) exactly into

    observed = elapsed + engine + path + left

``elapsed``: the query's time in the router before the estimate (``ttft_elapsed``); ``engine``:
the estimate's replay of the scheduler (``ttft − ttft_elapsed − ttft_path``); ``path``: the path
term the calibration added (``ttft_path``, 0 before it is fitted); ``left``: what none of them
explains (dispatch → first byte beyond the path term, and the replay's own error). The path model
``bear.calibrator.path`` would fit from the same records is reported beside it, with the error
left once it is added: what the online fit converges to on that traffic.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bear.calibrator.path import fit_path


def _parts(rec: dict[str, Any]) -> tuple[str, float, float, float, float, float] | None:
    """(instance, prompt tokens, observed, elapsed, engine, path) of one BEA-estimated done record."""
    if rec.get("status") != "done" or rec.get("engine_streamed") is False:  # unstreamed: no first token seen
        return None
    inst = rec.get("instance")
    c = (rec.get("candidates") or {}).get(inst)
    obs = rec.get("observed_ttft_s")
    if not isinstance(c, dict) or c.get("method") != "bea" or not isinstance(obs, int | float):
        return None
    ttft = c.get("ttft")
    if not isinstance(ttft, int | float) or not math.isfinite(ttft):
        return None
    elapsed = float(c.get("ttft_elapsed") or 0.0)
    path = float(c.get("ttft_path") or 0.0)
    n = rec.get("instance_prompt_tokens", c.get("prompt_tokens", 0)) or 0
    return str(inst), float(n), float(obs), elapsed, float(ttft) - elapsed - path, path


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _errors(pred: list[float], obs: list[float]) -> tuple[float, float]:
    """(MAPE, median signed relative error), both in %."""
    rel = [(p - o) / o for p, o in zip(pred, obs, strict=True) if o > 0]
    if not rel:
        return math.nan, math.nan
    return 100.0 * sum(abs(r) for r in rel) / len(rel), 100.0 * _q(rel, 0.5)


def decompose(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per instance: n, MAPE and median signed error of the estimate as made, the mean of each
    part (seconds; they sum to the mean observed TTFT), the residual outside the replay
    (observed − elapsed − engine) p10/p50/p90, the path fit over it, and the error with it."""
    by: dict[str, list[tuple[float, float, float, float, float]]] = defaultdict(list)
    for rec in records:
        p = _parts(rec)
        if p is not None:
            by[p[0]].append(p[1:])
    out: dict[str, dict[str, Any]] = {}
    for inst, rows in sorted(by.items()):
        n = len(rows)
        obs = [r[1] for r in rows]
        pred = [r[2] + r[3] + r[4] for r in rows]
        resid = [r[1] - r[2] - r[3] for r in rows]
        mape, bias = _errors(pred, obs)
        fit = fit_path([(r[0], x) for r, x in zip(rows, resid, strict=True)], min_count=1)
        with_fit = [r[2] + r[3] + (fit.at(r[0]) if fit else 0.0) for r in rows]
        mape_fit, bias_fit = _errors(with_fit, obs)
        out[inst] = {
            "n": n, "mape_pct": mape, "median_signed_pct": bias,
            "observed_s": sum(obs) / n, "elapsed_s": sum(r[2] for r in rows) / n,
            "engine_s": sum(r[3] for r in rows) / n, "path_s": sum(r[4] for r in rows) / n,
            "left_s": sum(o - p for o, p in zip(obs, pred, strict=True)) / n,
            "residual_p10_s": _q(resid, 0.1), "residual_p50_s": _q(resid, 0.5), "residual_p90_s": _q(resid, 0.9),
            "path_fit_a_s": fit.a if fit else None, "path_fit_b_s_per_token": fit.b if fit else None,
            "mape_with_fit_pct": mape_fit, "median_signed_with_fit_pct": bias_fit,
            "with_path": sum(1 for r in rows if r[4] > 0),
        }
    return out


def read_log(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON records of an outcome log (unreadable lines skipped)."""
    with path.open() as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield rec
