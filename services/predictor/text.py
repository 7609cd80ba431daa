"""Model-independent tokenisation of a prompt into pieces, fast enough for the request path.

A piece is a run of word bytes (ASCII letters/digits and every non-ASCII byte, lower-cased) or one
punctuation byte; whitespace separates pieces. Pieces are what the hashed feature vector is built
from and what the fallback token count counts. They are deliberately not a model tokenizer: the
features must not change when a tokenizer file appears on or disappears from a host.

Speed: counts (pieces, sentences) cover the whole text with a few vectorised numpy passes; the
hashes are computed in numpy (no per-word Python loop) over at most ``HASH_HEAD + HASH_TAIL`` bytes
(the start and the end of the prompt, where instructions sit). The hashed vector is normalised by
the number of hashed pieces, so for a long prompt it is an estimate of the full-text vector.

This module is the definition. The request path (``features.analyse``) uses its C++ port in
``bear.libbea`` (libbea/src/prompt_text.cpp), which gives the same hashes, counts and vector bit for
bit (tests/test_predictor_native.py compares them on thousands of prompts) in a few µs to tens of
µs instead of ~0.1-0.7 ms.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np

HASH_HEAD = 6144
HASH_TAIL = 2048

_MIX = np.uint64(0x9E3779B97F4A7C15)
_WINDOW = HASH_HEAD + HASH_TAIL + 1


def _powers(base: int, n: int) -> np.ndarray:
    out = np.full(n, base, dtype=np.uint64)
    out[0] = 1
    with np.errstate(over="ignore"):
        return np.cumprod(out, dtype=np.uint64)


_POW = _powers(1_000_003, _WINDOW + 1)
_POW_INV = _powers(pow(1_000_003, -1, 2**64), _WINDOW + 1)


def _table(members: bytes) -> np.ndarray:
    t = np.zeros(256, dtype=bool)
    t[list(members)] = True
    return t


_IS_WORD = _table(bytes(range(48, 58)) + bytes(range(65, 91)) + bytes(range(97, 123)) + bytes(range(128, 256)))
_IS_SPACE = _table(bytes([9, 10, 11, 12, 13, 32]))
_IS_END = _table(b".!?")
_LOWER = np.arange(256, dtype=np.uint64)
_LOWER[65:91] += 32


@dataclass(frozen=True)
class Pieces:
    """Counts over the whole text and the 64-bit hashes of the pieces of its hashed window."""

    hashes: np.ndarray  # uint64, one per hashed piece, in order
    n_pieces: int  # pieces in the whole text
    n_bytes: int
    n_sentences: int


def count_pieces(raw: np.ndarray) -> tuple[int, int]:
    """(pieces, sentences) of UTF-8 bytes ``raw``: a few vectorised passes, no hashing."""
    n = len(raw)
    if n == 0:
        return 0, 0
    word = np.take(_IS_WORD, raw)
    space = np.take(_IS_SPACE, raw)
    n_words = int(np.count_nonzero(word[1:] > word[:-1])) + int(word[0])
    n_word_bytes = int(np.count_nonzero(word))
    n_punct = n - n_word_bytes - int(np.count_nonzero(space))
    # A sentence ends at . ! ? followed by whitespace or the end of the text; a trailing sentence
    # without a full stop counts too.
    end = np.take(_IS_END, raw)
    n_sent = int(np.count_nonzero(end[:-1] & space[1:])) + int(end[-1])
    last = np.flatnonzero(~space)
    if len(last) and not end[last[-1]]:
        n_sent += 1
    return n_words + n_punct, n_sent


def _hash_window(raw: np.ndarray) -> np.ndarray:
    n = len(raw)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    word = np.take(_IS_WORD, raw)
    punct = ~word & ~np.take(_IS_SPACE, raw)
    prev_word = np.empty_like(word)
    prev_word[0] = False
    prev_word[1:] = word[:-1]
    next_word = np.empty_like(word)
    next_word[-1] = False
    next_word[:-1] = word[1:]
    starts = np.flatnonzero((word & ~prev_word) | punct)
    ends = np.flatnonzero((word & ~next_word) | punct) + 1
    with np.errstate(over="ignore"):
        prefix = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(np.take(_LOWER, raw) * _POW[:n], dtype=np.uint64, out=prefix[1:])
        h = (prefix[ends] - prefix[starts]) * _POW_INV[starts]
        h = (h ^ (ends - starts).astype(np.uint64)) * _MIX
        h ^= h >> np.uint64(29)
    return h


def _cut(data: bytes, lo: int, hi: int) -> tuple[int, int]:
    """Move a byte range outwards/inwards so that it does not split a piece (whitespace bound)."""
    while lo > 0 and data[lo - 1 : lo] not in (b" ", b"\n", b"\t"):
        lo += 1
        if lo >= hi:
            break
    while hi < len(data) and data[hi : hi + 1] not in (b" ", b"\n", b"\t") and hi > lo:
        hi -= 1
    return lo, hi


SHORT_BYTES = 512  # below this, the pure-Python path is faster than numpy's per-call overheads
_PIECE_RE = re.compile(rb"[0-9A-Za-z\x80-\xff]+|[^0-9A-Za-z\x80-\xff\t\n\x0b\x0c\r ]")
_SENT_RE = re.compile(rb"[.!?](?=[\t\n\x0b\x0c\r ]|$)")
_M64 = (1 << 64) - 1
_P_INT = 1_000_003
_MIX_INT = 0x9E3779B97F4A7C15


@functools.lru_cache(maxsize=65536)
def _piece_hash(piece: bytes) -> int:
    """The same 64-bit hash as ``_hash_window``, for one piece (cached: words repeat)."""
    h = 0
    for b in reversed(piece.lower()):
        h = (h * _P_INT + b) & _M64
    h = ((h ^ len(piece)) * _MIX_INT) & _M64
    return h ^ (h >> 29)


def _pieces_short(data: bytes) -> Pieces:
    found = _PIECE_RE.findall(data)
    h = np.fromiter((_piece_hash(p) for p in found), dtype=np.uint64, count=len(found))
    n_sent = len(_SENT_RE.findall(data))
    stripped = data.rstrip(b"\t\n\x0b\x0c\r ")
    if stripped and stripped[-1:] not in (b".", b"!", b"?"):
        n_sent += 1
    return Pieces(h, len(found), len(data), n_sent)


def pieces(text: str) -> Pieces:
    """Counts over ``text`` and hashes of the pieces of its head and tail (stable across hosts)."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= SHORT_BYTES:
        return _pieces_short(data)
    raw = np.frombuffer(data, dtype=np.uint8)
    n_pieces, n_sent = count_pieces(raw)
    if len(data) <= HASH_HEAD + HASH_TAIL:
        h = _hash_window(raw)
    else:
        _, head_end = _cut(data, 0, HASH_HEAD)
        tail_start, _ = _cut(data, len(data) - HASH_TAIL, len(data))
        h = np.concatenate([_hash_window(raw[:head_end]), _hash_window(raw[tail_start:])])
    return Pieces(h, n_pieces, len(data), n_sent)


def hashed_vector(p: Pieces, dim: int = 512) -> np.ndarray:
    """Signed feature hashing of the hashed pieces, normalised by their count (paper A.4)."""
    if len(p.hashes) == 0:
        return np.zeros(dim, dtype=np.float64)
    bucket = ((p.hashes >> np.uint64(32)) % np.uint64(dim)).astype(np.intp)
    sign = ((p.hashes >> np.uint64(7)) & np.uint64(1)).astype(np.float64) * 2.0 - 1.0
    return np.bincount(bucket, weights=sign, minlength=dim) / len(p.hashes)
