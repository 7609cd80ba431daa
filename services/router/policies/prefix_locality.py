"""Prefix-locality routers, as the production routers BEAR competes with score it. They see the
same ``Candidate`` fields as every policy: the prompt's length and prefix-cache hit at each
instance (the estimator's mirror of the instance's KV events — the "precise" prefix input these
routers get from vLLM's KV events), the waiting queue and the KV usage of the instance's newest
snapshot. None of them predicts the TTFT the hit buys; none looks at accuracy or cost.

* ``llm-d``: llm-d's default scorer set (llm-d/llm-d-inference-scheduler, ``pkg/epp/config/loader/
  defaults.go``): ``2·queue + 2·kv-cache-utilization + 3·prefix-cache``, weights not normalised,
  max-score picker with random tie-breaking. queue = (maxQ − Q)/(maxQ − minQ) over the
  candidates on the waiting-queue size (1 for all when equal); kv = 1 − KV usage; prefix =
  matched blocks / prompt blocks.
* ``dynamo-kv``: NVIDIA Dynamo's KV router (ai-dynamo/dynamo ``docs/router/kv_cache_routing.md``,
  ``lib/kv-router/src/scheduling/selector.rs``) at its defaults (overlap credit 1, prefill load
  scale 1, temperature 0): cost = prefill blocks after the overlap credit (the instance's pending
  prefill plus this prompt, less the cached blocks) + decode blocks (the instance's active KV
  blocks plus this request's), lowest cost wins.
* ``session-affinity``: sticky sessions — a query of a conversation goes where its session id
  hashes (rendezvous hashing over the healthy instances, so a pool change moves only the
  sessions of the instance that left); a query without a session joins the shortest queue.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from typing import ClassVar

from bear.router.policies.base import Candidate, Policy, QueryContext

DEFAULT_BLOCK = 16  # vLLM's default block size, for an instance whose block size is unknown


def _blocks(tokens: float, c: Candidate) -> float:
    return tokens / (c.block_size or DEFAULT_BLOCK)


class LlmdPolicy(Policy):
    name: ClassVar[str] = "llm-d"

    def __init__(self, queue_weight: float = 2.0, kv_weight: float = 2.0, prefix_weight: float = 3.0,
                 seed: int = 0) -> None:
        self.w = (queue_weight, kv_weight, prefix_weight)
        self._rng = random.Random(seed)

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        qs = [c.n_waiting for c in cands]
        lo, hi = min(qs), max(qs)
        out = []
        for c in cands:
            queue = 1.0 if hi == lo else (hi - c.n_waiting) / (hi - lo)
            kv = min(1.0, max(0.0, 1.0 - c.kv_usage))
            total = math.floor(_blocks(c.prompt_tokens, c))
            prefix = min(1.0, math.floor(_blocks(c.prefix_hit_tokens, c)) / total) if total > 0 else 0.0
            out.append(self.w[0] * queue + self.w[1] * kv + self.w[2] * prefix)
        return out

    def pick(self, q: QueryContext, cands: Sequence[Candidate], scores: Sequence[float]) -> int:
        best = max(scores)
        return self._rng.choice([k for k, s in enumerate(scores) if s == best])


class DynamoKvPolicy(Policy):
    name: ClassVar[str] = "dynamo-kv"

    def __init__(self, overlap_credit: float = 1.0, prefill_load_scale: float = 1.0) -> None:
        if not 0.0 <= overlap_credit <= 1.0:
            raise ValueError("overlap_credit must be in [0, 1]")
        self.overlap_credit = overlap_credit
        self.prefill_load_scale = prefill_load_scale

    def cost(self, c: Candidate) -> float:
        raw_prefill = _blocks(c.pending_prefill_tokens + c.prompt_tokens, c)
        prefill = max(0.0, raw_prefill - self.overlap_credit * _blocks(c.prefix_hit_tokens, c))
        decode = c.kv_blocks_used + math.ceil(_blocks(c.prompt_tokens, c))
        return self.prefill_load_scale * prefill + decode

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        return [-self.cost(c) for c in cands]


class SessionAffinityPolicy(Policy):
    name: ClassVar[str] = "session-affinity"

    @staticmethod
    def weight(session: str, instance: str) -> int:
        return int.from_bytes(hashlib.blake2b(f"{session}\0{instance}".encode(), digest_size=8).digest(), "big")

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        if q.session is None:
            return [-float(c.queue_len) for c in cands]
        return [float(self.weight(q.session, c.instance)) for c in cands]
