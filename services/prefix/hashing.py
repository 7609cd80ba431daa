"""vLLM's prefix-cache block hashes, computed here from token ids so that a mirror of an
instance's cache (fed by the engine's KV events, which name blocks by these hashes) can tell how
much of a new prompt that instance holds.

What vLLM 0.32 does (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``,
``init_none_hash``, ``get_request_block_hasher``; ``vllm/utils/hashing.py``):

* a prompt is cut into full blocks of ``block_size`` tokens (a partial last block is never
  hashed);
* block k's hash is ``H((parent, tuple(block_k_tokens), extra_keys))`` where ``parent`` is block
  k−1's hash and, for block 0, ``NONE_HASH = H(seed)``; ``extra_keys`` is None for plain text
  prompts (no LoRA, multimodal input or cache salt);
* ``H`` is ``--prefix-caching-hash-algo``: ``sha256`` (the default: SHA-256 of the pickle, highest
  protocol) or ``sha256_cbor`` (SHA-256 of canonical CBOR); the ``xxhash`` variants are not
  supported here (their seed is random per process unless PYTHONHASHSEED is set);
* ``seed`` is ``$PYTHONHASHSEED`` when the engine has it set, else ``"vllm-none-hash"``;
* KV events name a block by ``maybe_convert_block_hash``: the low 64 bits of the digest as an
  int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or the digest itself. BEAR's wire
  contract always uses the int form (``external``), whatever the engine sends.

The chain runs in libbea (``bear.libbea.BlockHasher``: both serialisations written byte for byte
in C++, SHA-256, a memo of links; about 20× faster than pickling and hashing here); the Python
functions below are the reference it is tested against and the fallback for block sizes past
libbea's limit (``native=False`` forces them).
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bear.protocol.token_ids import U32, unpack

DEFAULT_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED (PYTHONHASHSEED unset, sha256)
ALGOS = ("sha256", "sha256_cbor")
_MASK64 = (1 << 64) - 1


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


def external(digest: bytes) -> int:
    """The name KV events give a block: the low 64 bits of the digest, big-endian."""
    return int.from_bytes(digest, "big") & _MASK64


@dataclass(frozen=True)
class HashSpec:
    """How one instance names its blocks (from its registry entry)."""

    algo: str = "sha256"
    block_size: int = 16
    seed: str = DEFAULT_SEED

    def __post_init__(self) -> None:
        if self.algo not in HASH_FUNCTIONS:
            raise ValueError(f"prefix-caching hash algorithm {self.algo!r} is not supported (one of {', '.join(ALGOS)})")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")


def _native(spec: HashSpec, none_hash: bytes, memo: int) -> Any:
    from bear import libbea

    if spec.block_size > libbea.PREFIX_MAX_BLOCK_SIZE:
        return None
    return libbea.BlockHasher(spec.algo, spec.block_size, none_hash, memo)


def _u32(token_ids: Sequence[int] | bytes) -> Sequence[int]:
    """Token ids in a form libbea reads in place (a buffer of uint32): packed wire bytes are
    viewed, a list is packed once (OverflowError on an id outside 0 … 2^32 − 1)."""
    if isinstance(token_ids, bytes | bytearray):
        return unpack(token_ids)
    if isinstance(token_ids, memoryview | array):
        return token_ids
    return array(U32, token_ids)


class BlockHasher:
    """The block-hash chain of token sequences under one ``HashSpec``. Links already computed are
    remembered (``memo`` of them, keyed by the parent digest and the block's tokens — exact, no
    digest is guessed): the prompts whose hits matter are the ones that repeat, and a lookup
    costs a fraction of a SHA-256 over a pickle. ``native``: libbea's chain (None: where it
    covers the spec; True: required; False: the Python reference)."""

    def __init__(self, spec: HashSpec, memo: int = 65_536, native: bool | None = None) -> None:
        self.spec = spec
        self._fn = HASH_FUNCTIONS[spec.algo]
        self.none_hash = self._fn(spec.seed)
        self.memo = memo
        self._memo: dict[tuple[bytes, tuple[int, ...]], tuple[bytes, int]] = {}  # → (digest, name)
        self._nat = None if native is False else _native(spec, self.none_hash, memo)
        if native and self._nat is None:
            raise ValueError(f"libbea hashes blocks of at most {_limit()} tokens (block_size {spec.block_size})")

    @property
    def native(self) -> bool:
        return self._nat is not None

    def _count(self, token_ids: Sequence[int], max_blocks: int | None) -> int:
        n = len(token_ids) // self.spec.block_size
        return n if max_blocks is None else max(0, min(n, max_blocks))

    def _batches(self, token_ids: Sequence[int], max_blocks: int | None, digests: bool) -> Iterator[tuple[Any, ...]]:
        """libbea's chain in growing batches (1, 4, 16, … blocks): lazy enough that a caller who
        stops at the first block no instance holds pays for at most 4× the blocks it used."""
        toks = _u32(token_ids)
        n, first, parent, step = self._count(toks, max_blocks), 0, None, 1
        while first < n:
            got = self._nat.chain(toks, first, min(step, n - first), parent, digests)
            yield got
            first, parent, step = first + len(got[0]), got[1], step * 4

    def links(self, token_ids: Sequence[int], max_blocks: int | None = None) -> Iterator[tuple[bytes, int]]:
        """(digest, name) of each full block of ``token_ids``, lazily: a caller that stops at the
        first block no instance holds pays for that block only (about: see ``_batches``)."""
        if self._nat is not None:
            for names, _, ds in self._batches(token_ids, max_blocks, True):
                yield from zip(ds, names, strict=True)
            return
        yield from self._py_links(_u32(token_ids), max_blocks)

    def _py_links(self, token_ids: Sequence[int], max_blocks: int | None) -> Iterator[tuple[bytes, int]]:
        b = self.spec.block_size
        n = self._count(token_ids, max_blocks)
        fn, parent, memo = self._fn, self.none_hash, self._memo
        for k in range(n):
            block = tuple(token_ids[k * b:(k + 1) * b])
            link = memo.get((parent, block))
            if link is None:
                if len(memo) >= self.memo:
                    memo.clear()
                d = fn((parent, block, None))
                link = memo[(parent, block)] = (d, external(d))
            parent = link[0]
            yield link

    def digests(self, token_ids: Sequence[int], max_blocks: int | None = None) -> Iterator[bytes]:
        """The full digests of the full blocks of ``token_ids``."""
        return (d for d, _ in self.links(token_ids, max_blocks))

    def names(self, token_ids: Sequence[int], max_blocks: int | None = None) -> Iterator[int]:
        """The blocks' names as KV events carry them (``external``), lazily."""
        if self._nat is not None:
            return (h for names, _ in self._batches(token_ids, max_blocks, False) for h in names)
        return (h for _, h in self._py_links(_u32(token_ids), max_blocks))

    def held_run(self, token_ids: Sequence[int], max_blocks: int, holders: Sequence[Container[int]]) -> list[int]:
        """How many leading blocks of ``token_ids`` (at most ``max_blocks``) each holder (a set of
        block names) holds. libbea walks the chain in one call, copying the links of the
        longest recent prompt this one repeats (token ids compared, not hashed) and checking each
        holder per block; the reference walks ``names`` here."""
        if not holders:
            return []
        if self._nat is not None:
            from bear import libbea

            return list(libbea.prefix_held_run(self._nat, _u32(token_ids), max(0, max_blocks), list(holders)))
        if len(holders) == 1:  # the common case: one instance holds the prompt
            held, n = holders[0], 0
            for h in self.names(token_ids, max_blocks):
                if h not in held:
                    break
                n += 1
            return [n]
        run, alive = [0] * len(holders), list(range(len(holders)))
        for h in self.names(token_ids, max_blocks):
            alive = [i for i in alive if h in holders[i]]
            if not alive:
                break
            for i in alive:
                run[i] += 1
        return run

    def hashes(self, token_ids: Sequence[int], max_blocks: int | None = None) -> list[int]:
        """The blocks' names as KV events carry them (``external``), all at once."""
        if self._nat is not None:
            toks = _u32(token_ids)
            n = self._count(toks, max_blocks)
            return self._nat.chain(toks, 0, n, None, False)[0] if n else []
        return list(self.names(token_ids, max_blocks))

    def next_digest(self, parent: bytes | None, block: Sequence[int]) -> bytes:
        """One link of the chain (``parent`` None: the first block)."""
        return self._fn((self.none_hash if parent is None else parent, tuple(block), None))


def _limit() -> int:
    from bear import libbea

    return int(libbea.PREFIX_MAX_BLOCK_SIZE)
