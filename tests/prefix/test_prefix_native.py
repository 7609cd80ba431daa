"""libbea's block hashing (``bear.libbea.BlockHasher``) against the Python reference: the bytes it
hashes equal ``pickle.dumps`` / ``cbor2.dumps(canonical=True)`` of vLLM's block tuple, every wire
form of token ids gives the same chain, the chain stays lazy, and the C++ driver passes under
ASan+UBSan. (The golden tests in test_hashing.py run both implementations against vLLM.)"""

from __future__ import annotations

import hashlib
import pickle
import random
import re
import subprocess
from array import array
from collections.abc import Callable
from pathlib import Path

import cbor2
import pytest

from bear import libbea
from bear.prefix.hashing import BlockHasher, HashSpec
from bear.protocol.token_ids import pack, unpack

EDGES = [0, 1, 255, 256, 65_535, 65_536, 2**31 - 1, 2**31, 2**32 - 1]


def _blocks(rng: random.Random, n: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        size = rng.choice([1, 2, 3, 4, 5, 16, 17, 64, 300])
        out.append([rng.choice(EDGES) if rng.random() < 0.3 else rng.randrange(2**rng.choice([8, 16, 31, 32]))
                    for _ in range(size)])
    return out


def test_serialisation_is_byte_for_byte_pythons() -> None:
    rng = random.Random(1)
    for block in _blocks(rng, 300):
        parent = hashlib.sha256(bytes(rng.getrandbits(8) for _ in range(8))).digest()
        obj = (parent, tuple(block), None)
        assert libbea.prefix_serialize_block("sha256", parent, block) == pickle.dumps(obj, protocol=5)
        assert libbea.prefix_serialize_block("sha256_cbor", parent, block) == cbor2.dumps(obj, canonical=True)


def test_sha256_matches_hashlib() -> None:
    rng = random.Random(2)
    for n in [0, 1, 55, 56, 63, 64, 65, 119, 120, 1000]:
        data = bytes(rng.getrandbits(8) for _ in range(n))
        assert libbea.prefix_sha256(data) == hashlib.sha256(data).digest()


@pytest.mark.parametrize("spec", [HashSpec(), HashSpec(block_size=3, seed="0"), HashSpec(algo="sha256_cbor", block_size=32)])
def test_native_chain_equals_python(spec: HashSpec) -> None:
    rng = random.Random(3)
    toks = [rng.choice(EDGES) if rng.random() < 0.1 else rng.randrange(50_000) for _ in range(2000)]
    py, nat = BlockHasher(spec, native=False), BlockHasher(spec, native=True)
    want = py.hashes(toks)
    assert len(want) == 2000 // spec.block_size
    for form in (toks, pack(toks), unpack(pack(toks)), array("I", toks)):
        assert nat.hashes(form) == want
        assert list(nat.names(form)) == want
        assert list(nat.names(form, 7)) == want[:7]
    assert [d for d, _ in nat.links(toks)] == list(py.digests(toks))
    assert nat.hashes(toks) == want  # memoised now: same answer
    assert nat.hashes(toks[: spec.block_size - 1]) == [] and nat.hashes([]) == []


def test_names_are_lazy() -> None:
    """A caller that stops after the first block has made libbea hash about one block, not all."""
    h = BlockHasher(HashSpec(), native=True)
    toks = list(range(8192))
    it = h.names(toks)
    next(it)
    assert h._nat.memo_size == 1
    assert len(list(it)) == 511 and h._nat.memo_size == 512


def test_bad_token_forms_refused() -> None:
    h = BlockHasher(HashSpec(), native=True)
    with pytest.raises(ValueError, match="multiple of 4"):
        h.hashes(b"\x00" * 6)
    with pytest.raises(OverflowError):
        h.hashes([2**32] * 16)
    with pytest.raises(ValueError):
        h._nat.chain(array("H", [1] * 16), 0, 1)  # 2-byte items are not token ids
    with pytest.raises(ValueError, match="block_size"):
        libbea.BlockHasher("sha256", 0, b"\x00" * 32)
    with pytest.raises(ValueError, match="xxhash"):
        libbea.BlockHasher("xxhash", 16, b"\x00" * 32)


def test_block_size_past_libbea_falls_back() -> None:
    spec = HashSpec(block_size=libbea.PREFIX_MAX_BLOCK_SIZE + 1)
    assert not BlockHasher(spec).native
    with pytest.raises(ValueError, match="at most"):
        BlockHasher(spec, native=True)


@pytest.mark.slow
def test_sanitized_prefix_fuzz(tmp_path: Path, sanitized_tool: Callable[[str], Path]) -> None:
    """libbea/fuzz/prefix_check.cpp under ASan+UBSan: random token streams, block sizes 1–64, both
    algorithms, edge-value ids."""
    check = sanitized_tool("bea_prefix_check")
    rng = random.Random(5)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(400):
        n = rng.choice([0, 1, 2, 3, 7, 64, 67, 1000, 4099])
        ids = [rng.choice(EDGES) for _ in range(n // 4)]
        data = bytes(rng.getrandbits(8) for _ in range(3)) + pack(ids) + bytes(rng.getrandbits(8) for _ in range(n % 4))
        (corpus / f"{k:05d}").write_bytes(data)
    files = sorted(str(p) for p in corpus.iterdir())
    blocks = 0
    for k in range(0, len(files), 200):
        out = subprocess.run([str(check), *files[k : k + 200]], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-4000:]
        m = re.search(r"checked (\d+) inputs, (\d+) blocks", out.stdout)
        assert m is not None, out.stdout
        blocks += int(m.group(2))
    assert blocks > 1000
