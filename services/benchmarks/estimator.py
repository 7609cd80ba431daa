"""``bear bench estimator``: per-estimate time and memory of the BEA replay (and, in
``bear.benchmarks.estimator_ingest``, what keeping each instance's state costs per engine step).

Timing is measured inside C++ around each call (``libbea.time_estimates``) so that the numbers
are the estimator's own; the Python call overhead is measured separately through
``libbea.estimate_many`` (what the estimator service calls). RSS is read before and after
``n`` estimates to show that repeated estimates do not grow memory.
"""

from __future__ import annotations

import json
import random
import resource
from pathlib import Path
from typing import Any

import numpy as np

from bear import libbea
from bear.protocol import schemas


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def synthetic_snapshot(
    n_running: int,
    n_waiting: int,
    prompt: int,
    budget: int,
    block_size: int,
    max_num_seqs: int,
    seed: int = 0,
    num_gpu_blocks: int = 200_000,
) -> tuple[dict[str, Any], dict[str, int]]:
    """A busy instance: decoding residents with progress spread out, a queue of fresh prompts."""
    rng = random.Random(seed)
    running, lengths = [], {}
    used = 0
    for k in range(n_running):
        out = rng.randint(1, 400)
        p = prompt
        c = p + out - 1
        blocks = -(-c // block_size)
        used += blocks
        rid = f"r{k}"
        running.append(
            {"id": rid, "prompt_tokens": p, "computed_tokens": c, "output_tokens": out, "max_tokens": 4096,
             "blocks": blocks, "exclusive_blocks": blocks, "preemptions": 0, "arrival": float(k), "priority": 0}
        )
        lengths[rid] = out + rng.randint(1, 600)
    waiting = []
    for k in range(n_waiting):
        rid = f"w{k}"
        waiting.append(
            {"id": rid, "prompt_tokens": prompt, "computed_tokens": 0, "output_tokens": 0, "max_tokens": 4096,
             "blocks": 0, "exclusive_blocks": 0, "preemptions": 0, "arrival": 1000.0 + k, "priority": 0}
        )
        lengths[rid] = rng.randint(50, 800)
    snap = {
        "schema": schemas.SNAPSHOT,
        "instance": "bench",
        "seq": 1,
        "time": 2000.0,
        "config": {
            "max_num_batched_tokens": budget, "max_num_scheduled_tokens": budget, "max_num_seqs": max_num_seqs,
            "long_prefill_token_threshold": 0, "enable_chunked_prefill": True, "policy": "fcfs",
            "block_size": block_size, "num_gpu_blocks": num_gpu_blocks, "max_model_len": 32768,
            "enable_prefix_caching": True, "async_scheduling": False, "scheduler_reserve_full_isl": True,
            "watermark_blocks": 0,
        },
        "free_blocks": num_gpu_blocks - 1 - used,
        "running": running,
        "waiting": waiting,
        "inflight": None,
    }
    return snap, lengths


BETA = [8e-3, 4e-5, 2e-8, 5e-11]


def scenarios() -> list[tuple[str, dict[str, Any], dict[str, int], dict[str, Any]]]:
    out = []
    snap, lengths = synthetic_snapshot(8, 2, prompt=1024, budget=2048, block_size=16, max_num_seqs=256)
    out.append(("a: 8 running / 2 waiting", snap, lengths, {"prompt_tokens": 1024, "max_tokens": 256}))
    snap, lengths = synthetic_snapshot(64, 32, prompt=8192, budget=8192, block_size=16, max_num_seqs=256)
    out.append(("b: 64 running / 32 waiting, 8k prompts (max_num_seqs 256)", snap, lengths,
                {"prompt_tokens": 8192, "max_tokens": 256}))
    snap, lengths = synthetic_snapshot(64, 32, prompt=8192, budget=8192, block_size=16, max_num_seqs=64)
    out.append(("b': same, admission-bound (max_num_seqs 64)", snap, lengths,
                {"prompt_tokens": 8192, "max_tokens": 256}))
    return out


def _stats(samples: np.ndarray) -> dict[str, float]:
    return {"median_us": float(np.median(samples) * 1e6), "p99_us": float(np.percentile(samples, 99) * 1e6)}


def run_bench(n: int, timing_reps: int, cases_path: Path | None, as_json: bool,
              population_reps: int = 0, ingest_steps: int = 0, ingest_passes: int = 3,
              nats_seconds: float = 0.0) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from bear.replay.cases import read_cases

    console = Console(stderr=True)
    rows: list[dict[str, Any]] = []
    with Progress(console=console, transient=True) as progress:
        scen = scenarios()
        task = progress.add_task("benchmarking", total=len(scen) + 1)
        for name, snap_d, lengths, query in scen:
            snap = libbea.Snapshot.from_dict(snap_d)
            snap.set_output_lengths(lengths)
            ref = libbea.estimate(snap, query, beta=BETA)
            per_call = np.asarray(libbea.time_estimates(snap, query, BETA, timing_reps, True))
            t0 = _rss_mib()
            total = libbea.time_estimates(snap, query, BETA, n, False)[0]
            t1 = _rss_mib()
            py = np.asarray([_py_call(snap, query) for _ in range(min(timing_reps, 5000))])
            rows.append({"scenario": name, "n_batches": ref["n_batches"], **_stats(per_call),
                         "mean_us_bulk": total / n * 1e6, "python_call_median_us": float(np.median(py) * 1e6),
                         "rss_before_mib": t0, "rss_after_mib": t1, "estimates": n})
            progress.advance(task)
        # (c) the public real-vLLM cases: every case timed, pooled.
        path = cases_path or Path(__file__).resolve().parents[2] / "tests/data/vllm-cpu-traces/cases.jsonl.gz"
        case_list = list(read_cases(path))
        prepared = []
        for c in case_list:
            s = libbea.Snapshot.from_dict(c["snapshot"])
            s.set_output_lengths(c["output_lengths"])
            prepared.append((s, c["request"]))
        reps = max(1, timing_reps // len(prepared))
        samples = np.concatenate([np.asarray(libbea.time_estimates(s, q, BETA, reps, True)) for s, q in prepared])
        per_case = max(1, n // len(prepared))
        t0 = _rss_mib()
        total = sum(libbea.time_estimates(s, q, BETA, per_case, False)[0] for s, q in prepared)
        t1 = _rss_mib()
        rows.append({"scenario": f"c: public real-vLLM cases ({len(prepared)})",
                     "n_batches": float(np.mean([libbea.estimate(s, q, beta=BETA)["n_batches"] for s, q in prepared])),
                     **_stats(samples), "mean_us_bulk": total / (per_case * len(prepared)) * 1e6,
                     "python_call_median_us": float("nan"), "rss_before_mib": t0, "rss_after_mib": t1,
                     "estimates": per_case * len(prepared)})
        progress.advance(task)
    result: dict[str, Any] = {"rows": rows}
    if population_reps > 0:
        result["population"] = run_population(population_reps, as_json=as_json, print_table=False)
    if ingest_steps > 0:
        from bear.benchmarks.estimator_ingest import run_ingest

        result["ingest"] = run_ingest(ingest_steps, ingest_passes, nats_seconds)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        table = Table(title="BEA estimate time (C++, one core)")
        for col in ["scenario", "batches", "median µs", "p99 µs", "bulk mean µs", "py call µs", "RSS before→after MiB"]:
            table.add_column(col)
        for r in rows:
            table.add_row(r["scenario"], f"{r['n_batches']:.0f}", f"{r['median_us']:.2f}", f"{r['p99_us']:.2f}",
                          f"{r['mean_us_bulk']:.2f}",
                          "-" if r["python_call_median_us"] != r["python_call_median_us"] else f"{r['python_call_median_us']:.2f}",
                          f"{r['rss_before_mib']:.1f} → {r['rss_after_mib']:.1f} ({r['estimates']:,} estimates)")
        Console().print(table)
        if population_reps > 0:
            _print_population(result["population"])
        if ingest_steps > 0:
            from bear.benchmarks.estimator_ingest import print_ingest

            print_ingest(result["ingest"])
    return result


# Estimate time vs population: decoding residents with 1k-token prompts and a queue of 1k-token
# prompts, budget 2048, block size 16, max_num_seqs max(256, running) (the larger populations run at
# the cap, so the queue waits for finishes); the query is one more 1k-token prompt.
POPULATION_RUNNING = (64, 256, 1024)
POPULATION_WAITING = (0, 64, 256, 512)


def population_grid(
    running: tuple[int, ...] = POPULATION_RUNNING, waiting: tuple[int, ...] = POPULATION_WAITING
) -> list[tuple[int, int, dict[str, Any], dict[str, int], dict[str, Any]]]:
    out = []
    for n_running in running:
        for n_waiting in waiting:
            snap, lengths = synthetic_snapshot(n_running, n_waiting, prompt=1024, budget=2048, block_size=16,
                                               max_num_seqs=max(256, n_running))
            out.append((n_running, n_waiting, snap, lengths, {"prompt_tokens": 1024, "max_tokens": 256}))
    return out


DRAW_SIGMA = 0.6  # σ of log(actual / predicted) the draws use here: the 8B's and 32B's on bear eval's workload


def run_population(reps: int, as_json: bool = False, print_table: bool = True) -> list[dict[str, Any]]:
    """Median and p99 µs per estimate (timed in C++, one call at a time) over the population grid:
    against a prepared state with the point lengths, and — as the first estimate after each engine
    step, the state prepared in the call — with the point lengths and with the shipped length
    draws (``EstimatorConfig.length_draws``, σ = DRAW_SIGMA), and the draws against a prepared state."""
    from bear.estimator.estimate import EstimatorConfig

    draws = EstimatorConfig().length_draws
    rows: list[dict[str, Any]] = []
    for n_running, n_waiting, snap_d, lengths, query in population_grid():
        snap = libbea.Snapshot.from_dict(snap_d)
        snap.set_output_lengths(lengths)
        ref = libbea.estimate(snap, query, beta=BETA)
        samples = np.asarray(libbea.time_estimates(snap, query, BETA, reps, True))
        fresh = np.asarray(libbea.time_estimates(snap, query, BETA, reps, True, fresh=True))
        drawn = np.asarray(libbea.time_estimates(snap, query, BETA, reps, True, length_sigma=DRAW_SIGMA,
                                                 length_draws=draws, fresh=True))
        drawn_prepared = np.asarray(libbea.time_estimates(snap, query, BETA, reps, True, length_sigma=DRAW_SIGMA,
                                                          length_draws=draws))
        rows.append({"running": n_running, "waiting": n_waiting, "n_batches": ref["n_batches"], **_stats(samples),
                     "reps": reps, "length_draws": draws,
                     **{f"fresh_{k}": v for k, v in _stats(fresh).items()},
                     **{f"drawn_{k}": v for k, v in _stats(drawn).items()},
                     **{f"drawn_prepared_{k}": v for k, v in _stats(drawn_prepared).items()}})
    if print_table and not as_json:
        _print_population(rows)
    return rows


def _print_population(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    caption = "1k-token prompts, budget 2048, block size 16, max_num_seqs max(256, running)"
    for title, key in (("BEA estimate time vs population (C++, µs per estimate: median / p99)", ""),
                       ("… the state prepared in the call (the first estimate after an engine step), "
                        "point lengths", "fresh_"),
                       (f"… the state prepared in the call, {rows[0]['length_draws'] if rows else 0} length draws "
                        f"(σ {DRAW_SIGMA}, bear estimator's default)", "drawn_"),
                       (f"… against a prepared state, {rows[0]['length_draws'] if rows else 0} length draws "
                        f"(the shipped configuration)", "drawn_prepared_")):
        table = Table(title=title, caption=caption)
        table.add_column("running \\ waiting")
        for w in POPULATION_WAITING:
            table.add_column(str(w), justify="right")
        for n_running in POPULATION_RUNNING:
            cells = {r["waiting"]: r for r in rows if r["running"] == n_running}
            table.add_row(str(n_running), *(f"{cells[w][key + 'median_us']:.1f} / {cells[w][key + 'p99_us']:.1f}"
                                            if w in cells else "-" for w in POPULATION_WAITING))
        Console().print(table)


def _py_call(snap: Any, query: dict[str, Any]) -> float:
    import time

    t0 = time.perf_counter()
    libbea.estimate_many([snap], query, [BETA])
    return time.perf_counter() - t0
