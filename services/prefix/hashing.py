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
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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


class BlockHasher:
    """The block-hash chain of token sequences under one ``HashSpec``. Links already computed are
    remembered (``memo`` of them, keyed by the parent digest and the block's tokens — exact, no
    digest is guessed): the prompts whose hits matter are the ones that repeat, and a dict lookup
    costs a fraction of a SHA-256 over a pickle."""

    def __init__(self, spec: HashSpec, memo: int = 65_536) -> None:
        self.spec = spec
        self._fn = HASH_FUNCTIONS[spec.algo]
        self.none_hash = self._fn(spec.seed)
        self.memo = memo
        self._memo: dict[tuple[bytes, tuple[int, ...]], tuple[bytes, int]] = {}  # → (digest, name)

    def links(self, token_ids: Sequence[int], max_blocks: int | None = None) -> Iterator[tuple[bytes, int]]:
        """(digest, name) of each full block of ``token_ids``, lazily: a caller that stops at the
        first block no instance holds pays for that block only."""
        b = self.spec.block_size
        n = len(token_ids) // b
        if max_blocks is not None:
            n = min(n, max_blocks)
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
        return (h for _, h in self.links(token_ids, max_blocks))

    def hashes(self, token_ids: Sequence[int], max_blocks: int | None = None) -> list[int]:
        """The blocks' names as KV events carry them (``external``)."""
        return list(self.names(token_ids, max_blocks))

    def next_digest(self, parent: bytes | None, block: Sequence[int]) -> bytes:
        """One link of the chain (``parent`` None: the first block)."""
        return self._fn((self.none_hash if parent is None else parent, tuple(block), None))
