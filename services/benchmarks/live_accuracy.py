"""``bear bench live-accuracy``: the router's TTFT estimate against the observed TTFT, live.

Starts ``bear up`` (the sim stack, and with ``--backend vllm`` where a vLLM interpreter is found,
the real one) with a load, in a scratch directory, then decomposes the outcome log by source
(``bear.calibrator.live_error``): per instance, MAPE and median signed error of the queries
estimated before the calibrator published a path term (``ttft_path`` = 0) and after it (A/B in
one run), each part of the observed TTFT, the residual outside the replay. Figures are printed,
never asserted: they depend on the host.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bear.calibrator.live_error import decompose, read_log


def vllm_python() -> str | None:
    """The vLLM interpreter ``bear up --backend vllm`` would use, if one exists."""
    for p in (os.environ.get("BEAR_VLLM_PYTHON"), str(Path.home() / ".cache/bear/vllm-venv/bin/python")):
        if p and Path(p).exists():
            return p
    return None


def run_stack(backend: str, rate: float, duration: float, extra: list[str], workdir: Path) -> Path | None:
    """One ``bear up`` with a load through it; the router's outcome log (None: none written)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "bear", "up", "--load-rate", str(rate), "--load-duration", str(duration),
           *(["--backend", "vllm"] if backend == "vllm" else []), *extra]
    with (workdir / "up.log").open("w") as log:
        subprocess.run(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, check=False)
    logs = sorted(workdir.glob(".bear-up/runs/*/outcomes-router-*.jsonl"), key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None


def split(log: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """The decomposition of all queries, of those estimated without a path term, and with one."""
    recs = list(read_log(log))

    def path_of(r: dict[str, Any]) -> float:
        c = (r.get("candidates") or {}).get(r.get("instance")) or {}
        return float(c.get("ttft_path") or 0.0) if isinstance(c, dict) else 0.0

    return {"all": decompose(recs), "before (no path term)": decompose(r for r in recs if path_of(r) == 0.0),
            "after (path term)": decompose(r for r in recs if path_of(r) > 0.0)}


def run_bench(backends: list[str], rate: float, duration: float, vllm_args: list[str],
              workdir: Path | None = None) -> dict[str, Any]:
    base = workdir or Path(tempfile.mkdtemp(prefix="bear-live-accuracy-"))
    out: dict[str, Any] = {}
    for backend in backends:
        if backend == "vllm" and vllm_python() is None:
            out[backend] = {"skipped": "no vLLM interpreter ($BEAR_VLLM_PYTHON, ~/.cache/bear/vllm-venv)"}
            continue
        log = run_stack(backend, rate, duration, vllm_args if backend == "vllm" else [], base / backend)
        out[backend] = split(log) if log is not None else {"skipped": f"no outcome log in {base / backend}"}
        out[backend]["outcome_log"] = str(log)
    return out
