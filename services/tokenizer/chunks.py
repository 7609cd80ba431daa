"""Encoding long prompts without re-tokenising what an earlier prompt shared.

Prompts that prefix caching helps are the ones that repeat: every turn of a conversation resends
the last, documents and system prompts recur. Encoding an 8k-token prompt costs milliseconds; a
router that did it in full for every query would spend more on tokenising than on deciding. So
the text is cut into chunks at *safe boundaries* — a single space between two letters, where
every pre-tokenizer in use (byte-level BPE regexes, metaspace, whitespace) splits, so no token
crosses it — about every ``stride`` characters, each chunk named by the digest of the text up to its
end (two prompts share a chunk name only if they share everything up to its end).
A chunk's token ids are cached by name, packed (``bear.protocol.token_ids``: the estimate
request's wire form, so a prompt's ids are one ``bytes.join`` of its chunks, never a list of 8k
ints); a prompt is the cached ids of its leading chunks plus one encoding of the rest, whose
tokens are then split at the boundaries (by their character offsets) and cached in turn.

The rule is checked, not assumed: at load the chunked and the full encoding are compared on
probe texts, and every ``verify_every``-th encoding is compared again in full; a tokenizer that
ever disagrees is encoded in full from then on (``disabled`` says why). Tokenizers whose
post-processor adds tokens (a BOS) are encoded in full when special tokens are wanted.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from typing import Any

import structlog

from bear.protocol.token_ids import pack, unpack

log = structlog.get_logger("bear.tokenizer")

_SAFE = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")  # one space between two letters


class Deferred(Exception):
    """More new text than the caller's inline budget: encode it where blocking is allowed."""


class ChunkedEncoder:
    def __init__(self, tokenizer: Any, *, stride: int = 512, max_chunks: int = 65_536, verify_every: int = 256) -> None:
        self.tok = tokenizer
        self.stride = stride
        self.max_chunks = max_chunks
        self.verify_every = verify_every
        self.cache: dict[bytes, bytes] = {}  # chunk name → its ids, packed
        self.disabled: str | None = None
        self.encodings = 0
        self.hit_chars = 0
        self.total_chars = 0
        self._specials_free = tokenizer.encode("a b", add_special_tokens=True).ids == \
            tokenizer.encode("a b", add_special_tokens=False).ids
        self._probe()

    def _full(self, text: str, specials: bool) -> bytes:
        return pack(self.tok.encode(text, add_special_tokens=specials).ids)

    def _probe(self) -> None:
        rng = random.Random(0)
        words = ["alpha", "beta", "Ünïcode", "chat", "user", "<|im_start|>", "x1", "don't", "résumé"]
        for _ in range(8):
            text = " ".join(rng.choice(words) for _ in range(400)) + "\n\n  tail"
            self.cache.clear()
            self.encode(text[: rng.randrange(100, len(text))], False, check=False)  # caches a prefix
            if self.encode_packed(text, False, check=False) != self._full(text, False):
                self.disabled = "chunked encoding differs from the full encoding on probe texts"
                log.warning("tokenizer_chunking_off", reason=self.disabled)
                break
        self.cache.clear()

    def _boundaries(self, text: str) -> list[int]:
        out, pos, n = [], self.stride, len(text)
        while pos < n:
            m = _SAFE.search(text, pos)
            if m is None:
                break
            out.append(m.start())
            pos = m.start() + self.stride
        return out

    def encode(self, text: str, specials: bool, *, check: bool = True,
               verify: Callable[[Callable[[], None]], None] | None = None) -> list[int]:
        """The token ids of ``text`` (``specials``: with the post-processor's special tokens)."""
        return list(unpack(self.encode_packed(text, specials, check=check, verify=verify)))

    def encode_packed(self, text: str, specials: bool, *, check: bool = True,
                      verify: Callable[[Callable[[], None]], None] | None = None,
                      max_new_chars: int | None = None) -> bytes:
        """``encode``, packed as the estimate request carries token ids. ``max_new_chars``: raise
        ``Deferred`` (nothing changed) rather than encode more new text than this."""
        if self.disabled is not None or (specials and not self._specials_free) or len(text) < 2 * self.stride:
            if max_new_chars is not None and len(text) > max_new_chars:
                raise Deferred
            return self._full(text, specials)
        cuts = self._boundaries(text)
        parts: list[bytes] = []
        state, start, k = hashlib.blake2b(digest_size=16), 0, 0  # the digest of text[:start]
        raw = text.encode() if text.isascii() else None  # ASCII: char cuts are byte cuts, no slice copies
        view = memoryview(raw) if raw is not None else None
        while k < len(cuts):
            nxt = state.copy()
            nxt.update(view[start:cuts[k]] if view is not None else text[start:cuts[k]].encode())
            got = self.cache.get(nxt.digest())
            if got is None:
                break
            parts.append(got)
            state, start, k = nxt, cuts[k], k + 1
        if max_new_chars is not None and len(text) - start > max_new_chars:
            raise Deferred
        self.total_chars += len(text)
        self.hit_chars += start
        enc = self.tok.encode(text[start:], add_special_tokens=False)
        rest = pack(enc.ids)
        self._store(text, cuts[k:], start, state, rest, enc.offsets)
        parts.append(rest)
        ids = b"".join(parts)
        self.encodings += 1
        if check and verify is not None and self.verify_every and self.encodings % self.verify_every == 0:
            verify(lambda: self._verify(text, specials, ids))
        return ids

    def _store(self, text: str, cuts: list[int], start: int, state: Any, ids: bytes,
               offsets: list[tuple[int, int]]) -> None:
        """Cache the chunks of ``text[start:]`` that end at ``cuts`` (its ids: ``ids``, packed,
        with their character offsets from ``start``)."""
        if not cuts:
            return
        if len(self.cache) + len(cuts) > self.max_chunks:
            self.cache.clear()  # a bounded cache; the next prompts fill it again
        j, s, n = 0, start, len(offsets)
        for end in cuts:
            first = j
            while j < n and offsets[j][0] < end - start:  # the first token starting at or past the cut
                j += 1
            state.update(text[s:end].encode())
            self.cache[state.digest()] = ids[4 * first:4 * j]
            s = end

    def _verify(self, text: str, specials: bool, got: bytes) -> None:
        if self.disabled is None and got != self._full(text, specials):
            self.disabled = "a chunked encoding differed from the full one"
            self.cache.clear()
            log.warning("tokenizer_chunking_off", reason=self.disabled)
