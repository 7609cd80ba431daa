"""``bear bench prefix --micro``: the per-query pieces of exact tokens + hit lookup, timed in
process (no stack), each against the form it replaced — vLLM's block-hash chain of an 8k-token
prompt in Python and in libbea (cold: a new hasher; warm: the prompt seen before), the estimate
request with token ids as msgpack ints and as packed bytes, the whole hit lookup at a mirror
that holds the prompt, the estimator's whole answer for three candidates with and without the
prompt's ids (one of them holding the prompt: two distinct hits), and the router's chunked
encoding of a prompt whose document it has seen. Medians and p99 over ``reps`` runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bear.prefix.hashing import BlockHasher, HashSpec
from bear.prefix.hits import Hashers, Target, prefix_hits
from bear.prefix.mirror import PrefixMirror
from bear.protocol.messages import EstimateQuery, EstimateRequest, KvEvents, KvOp, KvState, decode, encode
from bear.protocol.token_ids import pack, unpack


def _time(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    xs = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    a = np.asarray(xs) * 1e3
    return {"p50_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)), "n": reps}


def _mirror(names: list[int], instance: str = "bench") -> PrefixMirror:
    m = PrefixMirror(instance)
    m.install(KvState(instance=instance, epoch="e", seq=-1, t=0.0))
    if names:
        m.apply(KvEvents(instance=instance, epoch="e", seq=0, t=0.0, ops=[KvOp("stored", names)]))
    return m


def _request(tokens: list[int] | bytes) -> EstimateRequest:
    return EstimateRequest(query=EstimateQuery(id="q", prompt_tokens=len(tokens)), instances=["a", "b", "c"],
                           tokens={"tok-bench": tokens})


def run_micro(prompt_tokens: int = 8192, block_size: int = 16, reps: int = 200, seed: int = 0,
              tokenizer: bool = True) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(0, 151_000, prompt_tokens)]
    packed = pack(ids)
    spec = HashSpec(block_size=block_size)
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "block_size": block_size,
                           "blocks": prompt_tokens // block_size}
    cold = max(5, reps // 10)  # a cold Python chain costs milliseconds: fewer runs
    warm_py, warm_nat = BlockHasher(spec, native=False), BlockHasher(spec, native=True)
    warm_py.hashes(ids)
    warm_nat.hashes(packed)
    out["hash"] = {
        "python_cold": _time(lambda: BlockHasher(spec, native=False).hashes(ids), cold),
        "python_warm": _time(lambda: warm_py.hashes(ids), reps),
        "libbea_cold": _time(lambda: BlockHasher(spec, native=True).hashes(packed), reps),
        "libbea_warm": _time(lambda: warm_nat.hashes(packed), reps),
        "libbea_warm_from_list": _time(lambda: warm_nat.hashes(ids), reps),
    }
    as_list, as_bytes = encode(_request(ids)), encode(_request(packed))
    out["estimate_request"] = {
        "bytes_list": len(as_list), "bytes_packed": len(as_bytes),
        "encode_list": _time(lambda: encode(_request(ids)), reps),
        "encode_packed": _time(lambda: encode(_request(packed)), reps),
        "decode_list": _time(lambda: decode(EstimateRequest, as_list), reps),
        "decode_packed": _time(lambda: unpack(decode(EstimateRequest, as_bytes).tokens["tok-bench"]), reps),
    }
    names = warm_nat.hashes(packed)
    targets = [Target(_mirror(names), spec)]
    py_hashers, nat_hashers = Hashers(), Hashers()
    py_hashers._by_spec[spec] = warm_py
    nat_hashers._by_spec[spec] = warm_nat
    view = unpack(packed)
    out["hit_lookup_warm"] = {
        "python_list": _time(lambda: prefix_hits(ids, targets, py_hashers), reps),
        "libbea_packed": _time(lambda: prefix_hits(view, targets, nat_hashers), reps),
    }
    out["estimate"] = _estimate_micro(packed, names, spec, reps)
    if tokenizer:
        out["tokenize"] = _tokenize_micro(prompt_tokens, reps, seed)
    return out


def candidate_store(names: list[int], spec: HashSpec) -> tuple[Any, float]:
    """Three synced candidates a, b, c (sim-engine snapshots, four residents each) whose prefix
    mirrors are a: ``names``, b and c: empty; and the capture time."""
    import time as _t

    from bear import libbea
    from bear.estimator.state import StateStore
    from bear.protocol.messages import InstanceRecord, PrefixCacheInfo
    from bear.sim.profile import load_profile

    engine = {**load_profile("qwen3-8b-h100").engine_config(), "block_size": spec.block_size,
              "num_gpu_blocks": 8000, "enable_prefix_caching": True}
    store, t0 = StateStore(), _t.time()
    for k, inst in enumerate(("a", "b", "c")):
        e = libbea.Engine(engine)
        for r in range(4):
            e.add(f"{inst}-{r}", 2000, 256, 100)
        e.step()
        e.finish_step()
        st = store.get(inst)
        st.on_registry(InstanceRecord(id=inst, model="m", base_url="http://x/v1", heartbeat=t0, config=engine,
                                      tokenizer="tok-bench",
                                      prefix_cache=PrefixCacheInfo(block_size=spec.block_size, events=True)))
        st.prefix = _mirror(names if k == 0 else [], inst)
        store.offer(inst, encode(e.snapshot(inst, "m", t0)), t0)
    return store, t0


def _estimate_micro(packed: bytes, names: list[int], spec: HashSpec, reps: int) -> dict[str, Any]:
    """The estimator's answer (``bear.estimator.estimate``: plan + replays) for three candidates
    (``candidate_store``: the first holds the whole prompt) with the prompt's ids (hits 8k, 0, 0:
    two distinct hits) and without (the estimated length at all three); and the replays alone
    (``run_jobs``) of each plan."""
    from bear.estimator.estimate import EstimatorConfig, estimate, plan, run_jobs
    from bear.protocol.messages import EstimateCandidate

    store, t0 = candidate_store(names, spec)
    cfg, now = EstimatorConfig(), t0 + 0.005
    q = EstimateQuery(id="q", prompt_tokens=len(packed) // 4, max_tokens=1)
    exact = [EstimateCandidate(instance=i, tokenizer="tok-bench") for i in ("a", "b", "c")]
    guessed = [EstimateCandidate(instance=i) for i in ("a", "b", "c")]
    tokens = {"tok-bench": packed}
    rows = estimate(q, exact, store, now, cfg, tokens=tokens)
    with_hits, without = plan(q, exact, store, now, cfg, tokens=tokens), plan(q, guessed, store, now, cfg)
    return {
        "hits": [r.prefix_hit_tokens for r in rows],
        "distinct_prompt_hits": len({(j.prompt_tokens, j.hit) for j in with_hits.jobs}),
        "with_ids_and_hits": _time(lambda: estimate(q, exact, store, now, cfg, tokens=tokens), reps),
        "without_ids": _time(lambda: estimate(q, guessed, store, now, cfg), reps),
        "replays_with_hits": _time(lambda: run_jobs(with_hits, cfg), reps),
        "replays_without": _time(lambda: run_jobs(without, cfg), reps),
    }


def _tokenize_micro(prompt_tokens: int, reps: int, seed: int) -> dict[str, Any]:
    """The router's chunked encoding of prompts over one seen document: the cost is the
    encoding of what follows the document's last cached chunk."""
    import tempfile
    from pathlib import Path

    from bear.benchmarks.prefix import _prompts, write_bench_tokenizer
    from bear.tokenizer.chunks import ChunkedEncoder

    with tempfile.TemporaryDirectory() as d:
        tok, vocab = write_bench_tokenizer(Path(d) / "tok", seed)
    prompts = _prompts(tok, vocab, reps + 1, prompt_tokens, 1, seed)
    ce = ChunkedEncoder(tok)
    ce.encode_packed(prompts[0], False)  # the document, seen once
    it = iter(prompts[1:])
    full = _time(lambda: tok.encode(prompts[0], add_special_tokens=False), max(5, reps // 20))
    h0, t0 = ce.hit_chars, ce.total_chars
    warm = _time(lambda: ce.encode_packed(next(it), False), reps)
    return {"full_encoding": full, "chunked_seen_document": warm,
            "cached_share_of_chars": (ce.hit_chars - h0) / max(1, ce.total_chars - t0),
            "chat_turn": _chat_micro(vocab, seed)}


def _chat_micro(vocab: list[str], seed: int, conversations: int = 30, turns: int = 4) -> dict[str, Any]:
    """A chat turn's encoding (what the router does before asking the estimator) with the last
    answer primed (``TokenizerCache.prime``, after the answer streamed) and without, warm and
    with the process idle 0.3 s before each turn (as a router between queries on a shared host).
    Lengths: LMSYS-Chat-1M's means per turn (69.5 user, 214.5 answer tokens; Zheng et al., ICLR
    2024, Table 1) and a 500-token system prompt (vLLM's multi-turn benchmark default); one bench
    word is about one token."""
    import tempfile
    from pathlib import Path

    from bear.benchmarks.prefix import write_bench_tokenizer
    from bear.tokenizer.bundle import from_model_dir
    from bear.tokenizer.cache import load

    rng = np.random.default_rng(seed + 7)

    def words(n: int) -> str:
        return " ".join(vocab[int(i)] for i in rng.integers(0, len(vocab), n))

    with tempfile.TemporaryDirectory() as d:
        write_bench_tokenizer(Path(d) / "tok", seed)
        bundle = from_model_dir(Path(d) / "tok")
    system = {"role": "system", "content": words(500)}
    out: dict[str, Any] = {}
    for idle in (0.0, 0.3):
        for primed in (True, False):
            tok = load(bundle)
            xs: list[float] = []
            for _ in range(conversations if not idle else conversations // 3):
                msgs = [system]
                for t in range(turns):
                    msgs = [*msgs, {"role": "user", "content": words(70)}]
                    if idle:
                        time.sleep(idle)
                    t0 = time.perf_counter()
                    tok.encode_packed(None, msgs)
                    if t:
                        xs.append(time.perf_counter() - t0)
                    answer = words(215)
                    if primed:
                        tok.prime(None, msgs, answer)
                    msgs = [*msgs, {"role": "assistant", "content": answer}]
            a = np.asarray(xs) * 1e3
            out[f"{'primed' if primed else 'not_primed'}_{'idle' if idle else 'warm'}"] = {
                "p50_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)), "n": len(xs)}
    return out
