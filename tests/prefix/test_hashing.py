"""BEAR's block hashing equals vLLM's: golden values computed by vLLM's own request block hasher
(tests/prefix/make_golden.py, run with the vLLM venv) for both supported algorithms, three block
sizes and three NONE_HASH seeds; the hit of a prompt at mirrors, capped as vLLM caps it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bear.prefix.hashing import DEFAULT_SEED, BlockHasher, HashSpec
from bear.prefix.hits import Hashers, Target, prefix_hits
from bear.prefix.mirror import PrefixMirror
from bear.protocol.messages import KvEvents, KvOp, KvState

GOLDEN = Path(__file__).resolve().parent / "data" / "block_hashes_golden.json.gz"


def golden() -> list[dict]:
    with gzip.open(GOLDEN, "rt") as f:
        return json.load(f)["cases"]


def test_golden_covers_the_grid() -> None:
    rows = golden()
    assert {r["algo"] for r in rows} == {"sha256", "sha256_cbor"}
    assert {r["seed"] for r in rows} == {None, "0", "12345"}
    assert sum(len(r["hashes"]) for r in rows) > 1000


@pytest.mark.parametrize("row", golden(), ids=lambda r: f"{r['algo']}-b{r['block_size']}-s{r['seed']}-n{len(r['tokens'])}")
def test_hashes_equal_vllm(row: dict) -> None:
    h = BlockHasher(HashSpec(algo=row["algo"], block_size=row["block_size"], seed=row["seed"] or DEFAULT_SEED))
    assert h.hashes(row["tokens"]) == row["hashes"]
    if row["digests"] is not None:
        assert [d.hex() for d in h.digests(row["tokens"])] == row["digests"]


def test_seed_and_algo_change_every_hash() -> None:
    toks = list(range(64))
    base = BlockHasher(HashSpec()).hashes(toks)
    assert set(base).isdisjoint(BlockHasher(HashSpec(seed="0")).hashes(toks))
    assert set(base).isdisjoint(BlockHasher(HashSpec(algo="sha256_cbor")).hashes(toks))


def test_unsupported_algorithm_refused() -> None:
    with pytest.raises(ValueError, match="xxhash"):
        HashSpec(algo="xxhash")


def _mirror_holding(hashes: list[int]) -> PrefixMirror:
    m = PrefixMirror("a")
    m.install(KvState(instance="a", epoch="e", seq=-1, t=0.0))
    m.apply(KvEvents(instance="a", epoch="e", seq=0, t=0.0, ops=[KvOp("stored", hashes)]))
    return m


def test_hits_per_instance_capped_like_vllm() -> None:
    spec = HashSpec(block_size=16)
    prompt = list(range(100, 164))  # 4 full blocks
    hs = BlockHasher(spec).hashes(prompt)
    full, half, none = _mirror_holding(hs), _mirror_holding(hs[:2]), _mirror_holding([1, 2, 3])
    hits = prefix_hits(prompt, [Target(full, spec), Target(half, spec), Target(none, spec)], Hashers())
    # the whole prompt cached: the last token is recomputed, so its block is not a hit
    assert hits == [48, 32, 0]
    assert prefix_hits([*prompt, 7], [Target(full, spec)], Hashers()) == [64]
    # blocks beyond a miss do not count (a hit is a prefix)
    assert prefix_hits(prompt, [Target(_mirror_holding([hs[0], hs[2], hs[3]]), spec)], Hashers()) == [16]


def test_hits_respect_each_instance_spec() -> None:
    prompt = list(range(300))
    s16, s32 = HashSpec(block_size=16), HashSpec(block_size=32)
    m16 = _mirror_holding(BlockHasher(s16).hashes(prompt))
    m32 = _mirror_holding(BlockHasher(s32).hashes(prompt))
    assert prefix_hits(prompt, [Target(m16, s16), Target(m32, s32), Target(m16, s32)], Hashers()) == [288, 288, 0]
