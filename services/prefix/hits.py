"""A prompt's prefix-cache hit at each of several instances, from its token ids and each
instance's mirror: what vLLM's ``find_longest_cache_hit`` would find there now.

The prompt is hashed once per distinct ``HashSpec`` (instances of one model family share the
chain), block by block, and only as far as some instance still holds the blocks: a prompt that
no instance has seen costs one block hash; one that repeats a recent prompt copies its links
(``BlockHasher.held_run``: one libbea call per spec, the mirrors checked there per block). The hit is capped as vLLM caps it: at least the last
prompt token is recomputed (``max_cache_hit_length = num_tokens − 1``), so a fully cached
prompt hits ``(P − 1) // block_size`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bear.prefix.hashing import BlockHasher, HashSpec
from bear.prefix.mirror import PrefixMirror


@dataclass
class Target:
    """One instance to find the hit at."""

    mirror: PrefixMirror
    spec: HashSpec


class Hashers:
    """One ``BlockHasher`` per spec (``NONE_HASH`` computed once)."""

    def __init__(self) -> None:
        self._by_spec: dict[HashSpec, BlockHasher] = {}

    def get(self, spec: HashSpec) -> BlockHasher:
        h = self._by_spec.get(spec)
        if h is None:
            h = self._by_spec[spec] = BlockHasher(spec)
        return h


def prefix_hits(tokens: Sequence[int], targets: Sequence[Target], hashers: Hashers) -> list[int]:
    """Hit tokens at each target (0 where its mirror holds no leading block)."""
    out = [0] * len(targets)
    groups: dict[HashSpec, list[int]] = {}
    for k, t in enumerate(targets):
        groups.setdefault(t.spec, []).append(k)
    n = len(tokens)
    for spec, ks in groups.items():
        cap = max(0, (n - 1) // spec.block_size)
        alive = [k for k in ks if len(targets[k].mirror)]
        if not alive or cap == 0:
            continue
        runs = hashers.get(spec).held_run(tokens, cap, [targets[k].mirror.counts for k in alive])
        for k, r in zip(alive, runs, strict=True):
            out[k] = r * spec.block_size
    return out
