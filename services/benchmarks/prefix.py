"""``bear bench prefix``: what exact prompt tokens and prefix-hit lookup cost the router's
decision, at long prompts, measured side by side.

One local stack (nats-server, the paper's three sim engines with a tokenizer and a prefix cache,
predictor, estimator) and two routers in the same queue group, so that they share every query
stream, instance and host condition: one tokenises (the default), the other runs with
``--no-tokenize`` (prompt lengths estimated from the text, no hits). Queries are ``prompt_tokens``-
token prompts built on a few long shared documents plus a short question, so that after each
document's first query an instance holds almost the whole prompt — the worst case for the lookup
(the estimator hashes nearly every block) and the case where hits matter.

Besides wall time, each router process's CPU time during the load (user + system, all threads:
the tokenizer's encoding runs in the router's thread pool) divided by the queries it answered:
the difference between the two routers is the CPU that exact tokens add per decision (the
relay of the answers is the same in both). What the routers spend idle (KV watches, heartbeats;
the same work in both) is measured over ``idle_s`` before each window, from both together, and
taken off at that rate: at a few queries per second it is milliseconds a query, and /proc counts
CPU in clock ticks (10 ms) — a tick in a 5-s idle measure was ±1 ms a query. The main thread
(the event loop) and the other threads (the tokenizer's pool, a native library's workers) are
reported apart, idle included. ``repeat`` windows on the one stack, each with documents of its
own, give the median.

The tokenizer is a byte-level BPE trained here (``tokenizers``) on the same synthetic text, with
a vocabulary like a production model's (32k), so that encoding costs what a real BPE costs per
token; the prompts are cut to exactly ``prompt_tokens`` of its tokens. Decision times come from
each router's outcome log (``decision_s``: submit received → dispatch published).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bear.runtime import aio
from bear.runtime.measure import cpu_seconds, latency_ms, main_thread_cpu_seconds

WORDS = 20_000


def _words(rng: np.random.Generator) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return ["".join(rng.choice(letters, size=int(rng.integers(2, 11)))) for _ in range(WORDS)]


def _text(rng: np.random.Generator, vocab: list[str], n: int) -> str:
    # Zipf-like word frequencies, as in natural text
    idx = np.minimum(rng.zipf(1.2, size=n) - 1, len(vocab) - 1)
    return " ".join(vocab[i] for i in idx)


def write_bench_tokenizer(out: Path, seed: int = 0) -> Any:
    """A 32k-vocabulary byte-level BPE trained on synthetic Zipf text, with the tiny model's chat
    template, written as a model directory; returns (the Tokenizer, the word list)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from bear.vllm_instance.tiny_model import CHAT_TEMPLATE

    rng = np.random.default_rng(seed)
    vocab = _words(rng)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32_000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((_text(rng, vocab, 2000) for _ in range(300)), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                           "chat_template": CHAT_TEMPLATE}))
    return tok, vocab


def _prompts(tok: Any, vocab: list[str], n: int, prompt_tokens: int, docs: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed + 1)
    documents = []
    for _ in range(docs):
        ids = tok.encode(_text(rng, vocab, int(prompt_tokens * 1.2))).ids[: prompt_tokens - 64]
        documents.append(tok.decode(ids))
    out = []
    for i in range(n):
        q = documents[i % docs] + f" question {i}: " + _text(rng, vocab, 80)
        ids = tok.encode(q).ids[:prompt_tokens]
        out.append(tok.decode(ids))
    return out




def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in recs if r.get("status") == "done" and not str(r["query_id"]).startswith("probe-")]


def _summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"decision": latency_ms([r["decision_s"] for r in recs]),
            "router_own": latency_ms([max(0.0, r["decision_s"] - r["wait_s"]) for r in recs]),
            "estimator_reply": latency_ms([r["estimate_s"] for r in recs]),
            "predictor_reply": latency_ms([r["predict_s"] for r in recs]),
            "tokenize": latency_ms([r.get("tokenize_s", 0.0) for r in recs]),
            "estimator_service": latency_ms([r["estimator_service_s"] for r in recs if r.get("estimator_service_s") is not None]),
            "tokens_exact": sum(r.get("tokens") == "exact" for r in recs),
            "prefix_hit_share": (sum(r.get("prefix_hit_tokens", 0) for r in recs)
                                 / max(1, sum(r.get("instance_prompt_tokens", r.get("prompt_tokens", 0)) for r in recs))),
            "queries": len(recs)}


def _queries(tok: Any, vocab: list[str], rate: float, duration: float, prompt_tokens: int, docs: int,
             seed: int) -> tuple[list[Any], np.ndarray]:
    """One window's queries (documents and questions of their own: ``seed``) and arrival times."""
    from bear.load.generator import LoadQuery
    from bear.load.targets import ttft_target_s

    n = max(2, round(rate * duration))
    prompts = _prompts(tok, vocab, n, prompt_tokens, docs, seed)
    rng = np.random.default_rng(seed + 2)
    queries = [LoadQuery(query_id=f"pb-{seed}-{i}-{time.time_ns() % 10**9}", task="doc-qa", prompt=p,
                         prompt_tokens=prompt_tokens, quality={}, target_s=float(ttft_target_s(prompt_tokens, rng)[0]))
               for i, p in enumerate(prompts)]
    return queries, np.cumsum(rng.exponential(1.0 / rate, n))


def run_prefix_bench(rate: float, duration: float, prompt_tokens: int = 8192, docs: int = 6, seed: int = 0,
                     tokenize_ms_reps: int = 200, idle_s: float = 15.0, repeat: int = 1) -> dict[str, Any]:
    """``repeat`` load windows on one stack, each with documents of its own (a new seed): each
    window's CPU per query on either router, and their median — one window's figure moves by
    a few tenths of a millisecond from run to run (a full garbage collection, ticks)."""
    from bear.stack.stack import Stack, StackConfig, wait_ready

    work = Path(tempfile.mkdtemp(prefix="bear-prefix-bench-"))
    tok, vocab = write_bench_tokenizer(work / "tokenizer", seed)
    first = _prompts(tok, vocab, 1, prompt_tokens, docs, seed)
    # the encoding alone, in this process, for scale
    t_enc = []
    for _ in range(tokenize_ms_reps):
        t = time.perf_counter()
        tok.encode(first[0])
        t_enc.append(time.perf_counter() - t)
    stack = Stack(StackConfig(workdir=work, calibrator=False, log_level="warning",
                              sim_args=["--tokenizer", str(work / "tokenizer")]))
    off_log = work / "outcomes-no-tokenize.jsonl"
    windows: list[dict[str, Any]] = []
    sent, errors = 0, {}
    with stack:
        # the second router: router-0's command line (identity, engine keys) without tokenising
        r0 = stack.children["router-0"]
        argv = list(r0.argv)
        argv[argv.index("--outcome-log") + 1] = str(off_log)
        extra = subprocess.Popen([*argv, "--no-tokenize"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 env={**os.environ, **r0.env})
        try:
            aio.run(wait_ready(stack.url, list(stack.instances), "bear", 60.0, stack, creds=stack.creds("admin")))
            time.sleep(2.0)  # the second router subscribed; tokenizers fetched
            pids = {"tokenize": stack.children["router-0"].proc.pid, "no_tokenize": extra.pid}  # type: ignore[union-attr]
            for r in range(repeat):
                queries, times = _queries(tok, vocab, rate, duration, prompt_tokens, docs, seed + 10 * r)
                done0 = {"tokenize": len(_records(stack.outcome_log(0))), "no_tokenize": len(_records(off_log))}
                idle0 = {k: cpu_seconds(pid, children=False) for k, pid in pids.items()}
                time.sleep(idle_s)
                cpu0 = {k: cpu_seconds(pid, children=False) for k, pid in pids.items()}
                main0 = {k: main_thread_cpu_seconds(pid) for k, pid in pids.items()}
                # one idle rate for both (the same idle work by construction), from both: a tick
                # (10 ms) in a few seconds, times the window, would otherwise be ~1 ms a query
                idle_rate = sum(cpu0[k] - idle0[k] for k in pids) / (len(pids) * idle_s)
                t0 = time.time()
                res = stack.run_load(queries, times)
                elapsed = time.time() - t0
                cpu1 = {k: cpu_seconds(pid, children=False) for k, pid in pids.items()}
                main1 = {k: main_thread_cpu_seconds(pid) for k, pid in pids.items()}
                sent += res.sent
                for k, v in res.errors.items():
                    errors[k] = errors.get(k, 0) + v
                recs = {"tokenize": _records(stack.outcome_log(0))[done0["tokenize"]:],
                        "no_tokenize": _records(off_log)[done0["no_tokenize"]:]}
                w: dict[str, Any] = {"wall_s": elapsed}
                for k in pids:
                    busy = cpu1[k] - cpu0[k] - idle_rate * elapsed
                    w[k] = {"queries": len(recs[k]), "cpu_ms_per_query": busy * 1e3 / max(1, len(recs[k])),
                            # the event loop's thread and the rest (the tokenizer's pools and workers), idle included
                            "main_thread_cpu_ms_per_query": (main1[k] - main0[k]) * 1e3 / max(1, len(recs[k])),
                            "other_threads_cpu_ms_per_query": (cpu1[k] - cpu0[k] - main1[k] + main0[k]) * 1e3
                            / max(1, len(recs[k])),
                            "idle_cpu_share": idle_rate}
                w["cpu_ms_added_per_decision"] = w["tokenize"]["cpu_ms_per_query"] - w["no_tokenize"]["cpu_ms_per_query"]
                windows.append(w)
        finally:
            extra.terminate()
            extra.wait(timeout=20)
    on, off = _summary(_records(stack.outcome_log(0))), _summary(_records(off_log))
    for k, summary in (("tokenize", on), ("no_tokenize", off)):
        summary["cpu_ms_per_query"] = float(np.median([w[k]["cpu_ms_per_query"] for w in windows]))
    ratio = {k: on["decision"][k] / off["decision"][k] - 1.0 for k in ("p50_ms", "p90_ms", "mean_ms")
             if on["decision"].get(k) and off["decision"].get(k)}
    return {"rate_qps": rate, "duration_s": duration, "prompt_tokens": prompt_tokens, "documents": docs,
            "sent": sent, "errors": errors, "windows": windows, "tokenize": on, "no_tokenize": off,
            "decision_overhead": ratio,
            "cpu_ms_added_per_decision": float(np.median([w["cpu_ms_added_per_decision"] for w in windows])),
            "encode_8k_in_process": latency_ms(t_enc), "cpus": os.cpu_count(), "host_load": os.getloadavg()}
