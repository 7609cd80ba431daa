"""The hit walk (``BlockHasher.held_run``): libbea's one-call walk — the links of a recent prompt
reused where a new one repeats its token ids, the memo, the mirrors checked per block — gives
what the Python reference walk and the plain chain give, for prompts that repeat, diverge at
any block, and outnumber the recent walks it keeps."""

from __future__ import annotations

import random

import pytest

from bear.prefix.hashing import BlockHasher, HashSpec
from bear.protocol.token_ids import pack


def brute(names: list[int], holders: list[set[int]]) -> list[int]:
    out = []
    for h in holders:
        k = 0
        while k < len(names) and names[k] in h:
            k += 1
        out.append(k)
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_native_walk_equals_the_reference(algo: str) -> None:
    rng = random.Random(4)
    spec = HashSpec(algo=algo, block_size=4)
    nat, ref, plain = BlockHasher(spec, native=True), BlockHasher(spec, native=False), BlockHasher(spec, memo=0)
    docs = [[rng.randrange(1 << 32) for _ in range(200)] for _ in range(12)]
    for trial in range(400):
        doc = list(rng.choice(docs))
        cut = rng.randrange(len(doc) + 1)
        prompt = doc[:cut] + [rng.randrange(1 << 32) for _ in range(rng.randrange(0, 40))]
        names = plain.hashes(prompt)
        holders = []
        for _ in range(rng.randrange(0, 4)):
            held = set(names[:rng.randrange(len(names) + 1)])
            if held and rng.random() < 0.3:
                held.discard(rng.choice(sorted(held)))  # a hole: the run stops there
            holders.append(held)
        cap = rng.randrange(len(names) + 2)
        want = brute(names[:cap], holders)
        form = pack(prompt) if trial % 2 else prompt
        assert nat.held_run(form, cap, holders) == want, trial
        assert ref.held_run(prompt, cap, holders) == want, trial
    assert nat.held_run(docs[0], 10, []) == []
    # dicts (the mirror's counts) as holders
    names = plain.hashes(docs[1])
    assert nat.held_run(docs[1], 100, [dict.fromkeys(names[:7], 1), {}]) == [7, 0]


def test_a_repeated_prompt_is_not_hashed_again() -> None:
    spec = HashSpec(block_size=16)
    h = BlockHasher(spec, memo=1_000_000, native=True)
    rng = random.Random(2)
    doc = [rng.randrange(150_000) for _ in range(8192)]
    names = BlockHasher(spec, memo=0).hashes(doc)
    held = set(names)
    assert h.held_run(doc, 511, [held]) == [511]
    hits0 = h._nat.memo_hits
    assert h.held_run(doc[:8000] + [1] * 192, 511, [held]) == [500]
    assert h._nat.memo_hits == hits0  # the shared 500 blocks came from the recent walk, not the memo
