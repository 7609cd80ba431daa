"""The prefix cache of a recorded run, replayed from the KV event batches the snapshotter logged
(``{"kv": {seq, ts, ops}}`` lines of ``--record-to``): what a mirror held after each engine step,
and so the hit a mirror computes for any prompt at that point — the input ``bear record`` gives
the replay cases instead of the engine's own admission numbers.

Alignment: vLLM publishes a step's events inside ``update_from_output`` (``ts`` = its wall
clock) and the plugin stamps the step's record (``wall``) right after that update, so a batch
belongs to the first step whose ``wall`` is not before its ``ts``; the state "after step s" is
every batch with ``ts ≤ wall(s)``. Generations (engine restarts) are cut at the last step of the
previous one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bear.prefix.hashing import HashSpec
from bear.prefix.hits import Hashers, Target, prefix_hits
from bear.prefix.mirror import PrefixMirror
from bear.protocol.jsonl import read_jsonl
from bear.protocol.messages import KvEvents, KvOp, KvState


def kv_batches(path: str | Path) -> list[dict[str, Any]]:
    """The KV event batches a step log holds, in the order they were logged."""
    return [obj["kv"] for obj in read_jsonl(path) if "kv" in obj]


def spec_of(meta: dict[str, Any]) -> HashSpec | None:
    """How the recorded engine hashed its blocks (None: prefix caching off or not recorded)."""
    pc = meta.get("prefix_cache") or {}
    if not pc.get("enabled") or pc.get("hash_seed") is None:
        return None
    try:
        return HashSpec(algo=str(pc.get("hash_algo", "sha256")), block_size=int(pc["block_size"]), seed=str(pc["hash_seed"]))
    except (KeyError, ValueError):
        return None


class RecordedCache:
    """One generation's cache, advanced step by step through its logged batches."""

    def __init__(self, spec: HashSpec, batches: Sequence[dict[str, Any]], steps: Sequence[dict[str, Any]]) -> None:
        self.spec = spec
        self.batches = sorted(batches, key=lambda b: (b["ts"], b["seq"]))
        self.wall = {st["seq"]: st["wall"] for st in steps}
        self.hashers = Hashers()

    def hits(self, queries: Iterable[tuple[int, Sequence[int]]]) -> list[int]:
        """For each (step seq, prompt token ids): the hit after that step (−1: before the first)."""
        qs = list(queries)
        order = sorted(range(len(qs)), key=lambda k: qs[k][0])
        out = [0] * len(qs)
        m = PrefixMirror()
        m.install(KvState(instance="recorded", epoch="r", seq=-1, t=0.0))
        nxt = 0
        for k in order:
            seq, toks = qs[k]
            until = self.wall.get(seq, float("-inf"))
            while nxt < len(self.batches) and self.batches[nxt]["ts"] <= until:
                b = self.batches[nxt]
                m.apply(KvEvents(instance="recorded", epoch="r", seq=m.seq + 1, t=b["ts"],
                                 ops=[KvOp(kind, list(hashes)) for kind, hashes in b["ops"]]))
                nxt += 1
            out[k] = prefix_hits(toks, [Target(m, self.spec)], self.hashers)[0]
        return out


def split_by_generation(batches: Sequence[dict[str, Any]],
                        gens: Sequence[tuple[dict[str, Any], list[dict[str, Any]]]]) -> list[list[dict[str, Any]]]:
    """Each generation's batches: those logged after the previous generation's last step and up
    to its own last step (an engine's first batches may be logged before its first step)."""
    out: list[list[dict[str, Any]]] = []
    lo = float("-inf")
    for _, steps in gens:
        hi = steps[-1]["wall"] if steps else lo
        out.append([b for b in batches if lo < b["ts"] <= hi])
        lo = hi
    return out


def find_prompt(prompts: dict[str, list[int]], engine_id: str) -> list[int] | None:
    """A request's prompt by the id the client gave (X-Request-Id), which the engine's own id
    contains (vLLM prefixes ``cmpl-`` and may suffix it)."""
    got = prompts.get(engine_id)
    if got is not None:
        return got
    for rid, toks in prompts.items():
        if rid in engine_id:
            prompts[engine_id] = toks
            return toks
    return None
