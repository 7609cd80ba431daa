"""The block pool of a recorded run, step by step, rebuilt from the plugin's block-op log
(``BEAR_SNAPSHOT_BLOCK_OPS=1``): for each replay case, the blocks its hits would use and where
they sit — the inputs of libbea's tracked-block replay under KV pressure (docs/estimator.md,
"What an exact replay under KV pressure needs").

For the case of request R whose snapshot is the state after step s: the pool after step s; the
hit chain of R and of every waiting request with nothing computed, found from its prompt's block
names (vLLM's hashing of its token ids, as the mirror does); each chain block's place in the free
queue (−1: held); per running request, its leading blocks up to the last one that is tracked or
shared with another running request (the ledger's rule: shared blocks must be tracked); and every
known prompt's full blocks as keys (``block_keys``: the names renamed to small ints per case), so
that the replay finds hits on blocks computed after the snapshot. Blocks that appear in none of
these stay counts (contract.md §2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bear.prefix.hashing import HashSpec
from bear.prefix.hits import Hashers
from bear.prefix.pool_replica import BlockPoolReplica
from bear.snapshotter.recorded_cache import find_prompt


def logged(steps: Sequence[dict[str, Any]]) -> bool:
    """Whether a generation's steps carry the block-op log (and who holds which block)."""
    return bool(steps) and steps[0].get("block_ops") is not None


def add_tracked_blocks(cases: list[dict[str, Any]], meta: dict[str, Any], steps: Sequence[dict[str, Any]],
                       spec: HashSpec, prompts: dict[str, list[int]]) -> dict[str, int]:
    """Give each case whose prompts are known its tracked blocks (module doc), in place: the
    snapshot's ``tracked_blocks`` (free-queue position or −1 per block), each running request's
    ``tracked``, each waiting request's and the request's ``hit_blocks`` (indices into it), and
    ``block_keys`` for every request whose prompt is known.
    Returns how many cases got them, and how many hits (requests' and waiting requests') the
    chain found that differ from the ``prefix_hit_tokens`` already there (the KV-event mirror's:
    the two views of one cache, expected 0)."""
    rep = BlockPoolReplica(int(meta["config"]["num_gpu_blocks"]))
    hasher = Hashers().get(spec)
    B = spec.block_size
    by_seq = sorted(range(len(cases)), key=lambda k: cases[k]["snapshot"]["seq"])
    done = differ = 0
    nxt = 0
    holders: dict[str, list[int]] = {}
    for k in by_seq:
        c = cases[k]
        s = c["snapshot"]["seq"]
        while nxt < len(steps) and steps[nxt]["seq"] <= s:
            rep.apply_all(steps[nxt].get("block_ops") or ())
            rep.check_free(int(steps[nxt]["free_blocks"]))
            holders = steps[nxt].get("block_ids") or {}
            nxt += 1
        want: list[tuple[dict[str, Any], list[int]]] = []
        req = c["request"]
        toks = find_prompt(prompts, req["id"])
        if toks is None:
            continue
        want.append((req, toks))
        for w in c["snapshot"]["waiting"]:
            wt = find_prompt(prompts, w["id"])
            if wt is not None and w.get("computed_tokens", 0) == 0:
                want.append((w, wt))
        pos = rep.positions()
        keys: dict[int, int] = {}  # block name -> the case's small key
        table: dict[int, int] = {}  # block id -> index in tracked_blocks
        for obj, t in want:
            names = list(hasher.names(t, len(t) // B))
            obj["block_keys"] = [keys.setdefault(n, len(keys)) for n in names]
            cap = max(0, (len(t) - 1) // B)
            chain = rep.chain(names[:cap], cap)
            obj["hit_blocks"] = [table.setdefault(b, len(table)) for b in chain]
            differ += int(obj.get("prefix_hit_tokens", 0)) != len(chain) * B
        running = c["snapshot"]["running"]
        held = [holders.get(r["id"], []) for r in running]
        count: dict[int, int] = {}
        for bl in held:
            for b in bl:
                count[b] = count.get(b, 0) + 1
        for r, bl in zip(running, held, strict=True):
            # a holder lists its leading blocks up to the last one tracked or shared with another
            last = max((i for i, b in enumerate(bl) if b in table or count[b] > 1), default=-1)
            r["tracked"] = [table.setdefault(b, len(table)) for b in bl[: last + 1]]
            rt = find_prompt(prompts, r["id"])
            if rt is not None:
                r["block_keys"] = [keys.setdefault(n, len(keys)) for n in hasher.names(rt, len(rt) // B)]
        c["snapshot"]["tracked_blocks"] = [pos.get(b, -1) for b in table]
        done += 1
    return {"cases": done, "hits_differ": differ}
