"""Encoding long prompts without re-tokenising what an earlier prompt shared.

Prompts that prefix caching helps are the ones that repeat: every turn of a conversation resends
the last, documents and system prompts recur. Encoding an 8k-token prompt costs milliseconds; a
router that did it in full for every query would spend more on tokenising than on deciding. So
a prompt is cut at *safe boundaries* — a single space between two letters, where every
pre-tokenizer in use (byte-level BPE regexes, metaspace, whitespace) splits, so no token crosses
it — about every ``stride`` characters, and the ids of the text before a boundary are the ids of
an earlier prompt that had the same text there.

The encoder remembers recent prompts (text, cuts, how many tokens precede each cut, the ids
packed as the estimate request carries them: ``bear.protocol.token_ids``), each filed where it
left the earlier prompt it was encoded from: under (that cut, its text from there to just past
its next cut — where the two differ, else that would be a shared cut too), or under (0, its text
to just past its first cut) when it had none. A new prompt starts at (0, its first chunk):
among the few prompts filed there, the longest run of cuts whose text it repeats (a binary search
over the cuts, each step one string comparison from the start — memcmp, no hashing, no Python
work per chunk) takes it to a cut ``c``; it then looks under (``c``, its next characters) for
prompts that left there its way, and so on — a conversation's turns are found turn by turn even
when many conversations share a system prompt. The ids up to the last shared cut are one slice;
the rest is encoded once, walked for its own cuts, and the prompt is filed in turn. A cut ``c`` of
an earlier prompt is a cut of the new one when they agree on ``text[:c + 2]``: the walk's every
decision up to ``c`` reads no further (the comparison is always from the start: a key only
says where to look).

The rule is checked, not assumed: at load the chunked and the full encoding are compared on
probe texts, and every ``verify_every``-th encoding is compared again in full; a tokenizer that
ever disagrees is encoded in full from then on (``disabled`` says why). Tokenizers whose
post-processor adds tokens (a BOS) are encoded in full when special tokens are wanted.
"""

from __future__ import annotations

import os
import random
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from bear.protocol.token_ids import pack, unpack

log = structlog.get_logger("bear.tokenizer")

_SAFE = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")  # one space between two letters


def encode_ids(tok: Any, texts: list[str], specials: bool) -> list[list[int]]:
    """Each text's token ids, the GIL released while the tokenizer works: its single-text
    ``encode`` holds the GIL for the whole call (an 8k-token prompt encoded in the router's
    thread pool stalled the router's event loop for 17 ms), its batch calls release it, and
    ``encode_batch_fast`` (tokenizers ≥ 0.21) skips the offsets no caller here needs — 35 % less
    time (docs/results/2026-12-01-prefix-cost-c.md). A batch is encoded in parallel
    unless ``encode_on_calling_thread`` turned that off (``bear router`` does)."""
    fast = getattr(tok, "encode_batch_fast", None)
    encs = (fast or tok.encode_batch)(texts, add_special_tokens=specials)
    return [e.ids for e in encs]


PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"


def encode_on_calling_thread() -> bool:
    """Have ``tokenizers`` encode a batch on the calling thread (the GIL still released) rather
    than in its rayon pool — unless ``TOKENIZERS_PARALLELISM`` is set already (the user's
    choice stands); returns whether it is now off. A router encodes a query's new text, a few
    hundred tokens: handing that to rayon's workers, which spin awhile for more work, cost
    ≈ 0.3 ms of CPU per decision more in the live side-by-side (docs/router.md, "Encoding on
    the calling thread"); a cold 8k prompt takes 9.4 ms on one thread against 6.0 ms on two
    cores. ``tokenizers`` reads the variable at every call."""
    os.environ.setdefault(PARALLELISM_ENV, "false")
    return os.environ[PARALLELISM_ENV].lower() in ("false", "0", "off", "no")


@dataclass(eq=False)
class Seen:
    """A prompt encoded before: its text, its cuts, the number of its tokens before each cut,
    its ids (packed); ``primed``: encoded ahead of a next turn (``prime``), ``used``: a later
    prompt started from it."""

    text: str
    cuts: list[int]
    ends: list[int]
    ids: bytes
    primed: bool = False
    used: bool = False


PRIME_DECAY = 0.97  # the weight of an earlier prime per answer since (a window of ≈ 30 answers)
PRIME_JUDGED_AFTER = 32  # primes before the share used is read
PRIME_MIN_USED = 0.1  # below this share of primes used, priming is paused …
PRIME_SAMPLE_EVERY = 16  # … all but one answer in this many (to see the workload change)


class Deferred(Exception):
    """More new text than the caller's inline budget: encode it where blocking is allowed."""


class ChunkedEncoder:
    def __init__(self, tokenizer: Any, *, stride: int = 512, max_chars: int = 32 << 20, per_key: int = 4,
                 verify_every: int = 256) -> None:
        self.tok = tokenizer
        self.stride = stride
        self.max_chars = max_chars  # prompt text held in all (the texts are the callers' strings, not copies)
        self.per_key = per_key  # recent prompts kept per key
        self.verify_every = verify_every
        self.seen: OrderedDict[tuple[int, str], list[Seen]] = OrderedDict()  # (cut, next chars) → newest first
        self.held_chars = 0
        self._lock = threading.Lock()  # the loop and the tokenizer pool share the encoder
        self.disabled: str | None = None
        self.encodings = 0
        self.hit_chars = 0
        self.total_chars = 0
        self.primes = 0  # encodings ahead of a next turn, all
        self._primed_w = 0.0  # … decayed per answer (PRIME_DECAY)
        self._used_w = 0.0  # … of those, later started from (decayed alike)
        self._paused = 0  # answers not primed while priming does not pay
        self._specials_free = tokenizer.encode("a b", add_special_tokens=True).ids == \
            tokenizer.encode("a b", add_special_tokens=False).ids
        self._probe()

    def _full(self, text: str, specials: bool) -> bytes:
        return pack(encode_ids(self.tok, [text], specials)[0])

    def clear(self) -> None:
        with self._lock:
            self.seen.clear()
            self.held_chars = 0

    def _probe(self) -> None:
        rng = random.Random(0)
        words = ["alpha", "beta", "Ünïcode", "chat", "user", "<|im_start|>", "x1", "don't", "résumé"]
        for _ in range(8):
            text = " ".join(rng.choice(words) for _ in range(400)) + "\n\n  tail"
            self.clear()
            self.encode(text[: rng.randrange(100, len(text))], False, check=False)  # files a prefix
            if self.encode_packed(text, False, check=False) != self._full(text, False):
                self.disabled = "chunked encoding differs from the full encoding on probe texts"
                log.warning("tokenizer_chunking_off", reason=self.disabled)
                break
        self.clear()

    def _boundaries(self, text: str, start: int = 0) -> list[int]:
        """The walk's cuts after ``start`` (0 or a cut)."""
        out, pos, n = [], start + self.stride, len(text)
        while pos < n:
            m = _SAFE.search(text, pos)
            if m is None:
                break
            out.append(m.start())
            pos = m.start() + self.stride
        return out

    @staticmethod
    def _shared(text: str, seen: Seen, beat: int) -> int:
        """How many of ``seen``'s leading cuts are cuts of ``text`` with the same text before them
        (module doc); ``beat`` or less when it is not more than ``beat``."""
        cuts, old = seen.cuts, seen.text

        def same(k: int) -> bool:  # text and old agree up to just past their k-th cut
            end = cuts[k - 1] + 2
            return text.startswith(old if end >= len(old) else old[:end])

        hi = len(cuts)
        if hi <= beat or not same(beat + 1):
            return beat
        if same(hi):
            return hi
        lo = beat + 1  # same(lo), not same(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if same(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def encode(self, text: str, specials: bool, *, check: bool = True,
               verify: Callable[[Callable[[], None]], None] | None = None) -> list[int]:
        """The token ids of ``text`` (``specials``: with the post-processor's special tokens)."""
        return list(unpack(self.encode_packed(text, specials, check=check, verify=verify)))

    def priming_pays(self) -> bool:
        """Whether to encode an answer ahead of its next turn. A prime saves the next turn's
        latency, not CPU (the answer is encoded once either way) — and costs a whole encoding
        when no next turn starts from it (documents asked once each, single-turn traffic). So
        once ``PRIME_JUDGED_AFTER`` primes were made, priming goes on while at least
        ``PRIME_MIN_USED`` of the recent ones were used, and is otherwise paused but for one
        answer in ``PRIME_SAMPLE_EVERY`` (the samples show when conversations come back)."""
        with self._lock:  # a window over answers, not primes: a pause lets the old primes age out
            self._primed_w *= PRIME_DECAY
            self._used_w *= PRIME_DECAY
        if self.primes < PRIME_JUDGED_AFTER or self._used_w >= PRIME_MIN_USED * self._primed_w:
            return True
        self._paused += 1
        return self._paused % PRIME_SAMPLE_EVERY == 0

    def prime_packed(self, text: str, specials: bool) -> bytes:
        """``encode_packed`` of a guess at a next turn's prompt, counted for ``priming_pays``."""
        with self._lock:
            self.primes += 1
            self._primed_w += 1.0
        return self.encode_packed(text, specials, check=False, primed=True)

    def encode_packed(self, text: str, specials: bool, *, check: bool = True,
                      verify: Callable[[Callable[[], None]], None] | None = None,
                      max_new_chars: int | None = None, primed: bool = False) -> bytes:
        """``encode``, packed as the estimate request carries token ids. ``max_new_chars``: raise
        ``Deferred`` (nothing changed) rather than encode more new text than this."""
        if not self.caches(specials) or len(text) < 2 * self.stride:
            if max_new_chars is not None and len(text) > max_new_chars:
                raise Deferred
            return self._full(text, specials)
        base, k = self._lookup(text)
        if base is not None and base.primed and not base.used and not primed:
            with self._lock:
                base.used = True
                self._used_w += 1.0
        start = base.cuts[k - 1] if base is not None else 0
        if max_new_chars is not None and len(text) - start > max_new_chars:
            raise Deferred
        self.total_chars += len(text)
        self.hit_chars += start
        head = base.ids[:4 * base.ends[k - 1]] if base is not None else b""
        cuts = base.cuts[:k] if base is not None else []
        ends = base.ends[:k] if base is not None else []
        new = self._boundaries(text, start)
        # the new text piece by piece between its cuts (no token crosses a cut: the rule this
        # encoder rests on), in one batch: the tokens before each cut are counted without offsets
        bounds = [start, *new, len(text)]
        parts = encode_ids(self.tok, [text[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)], False)
        n = len(head) // 4
        for part in parts[:-1]:  # each part but the last ends at a new cut
            n += len(part)
            ends.append(n)
        ids = head + b"".join(pack(part) for part in parts)
        self._file(self._key(text, start), Seen(text, cuts + new, ends, ids, primed=primed))
        self.encodings += 1
        if check and verify is not None and self.verify_every and self.encodings % self.verify_every == 0:
            verify(lambda: self._verify(text, specials, ids))
        return ids

    def caches(self, specials: bool) -> bool:
        """Whether encodings with (or without) special tokens go through the cache at all."""
        return self.disabled is None and (self._specials_free or not specials)

    def _key(self, text: str, cut: int) -> tuple[int, str]:
        """Where prompts that leave an earlier one at ``cut`` the way ``text`` does are filed."""
        m = _SAFE.search(text, cut + self.stride)
        return cut, text[cut:m.start() + 2 if m is not None else len(text)]

    def _lookup(self, text: str) -> tuple[Seen | None, int]:
        """The earlier prompt sharing the most leading cuts with ``text``, and how many (module doc)."""
        base, k, pos = None, 0, 0
        with self._lock:
            while True:
                key = self._key(text, pos)
                group = self.seen.get(key)
                if group is None:
                    return base, k
                self.seen.move_to_end(key)
                found = k
                for old in group:
                    j = self._shared(text, old, k)
                    if j > k:
                        base, k = old, j
                if k == found:
                    return base, k
                pos = base.cuts[k - 1]  # type: ignore[union-attr]

    def _file(self, key: tuple[int, str], seen: Seen) -> None:
        """Remember ``seen`` (newest first under its key; the oldest keys go past ``max_chars``)."""
        with self._lock:
            group = self.seen.get(key)
            if group is None:
                group = self.seen[key] = []
            else:
                self.seen.move_to_end(key)
            group.insert(0, seen)
            self.held_chars += len(seen.text)
            while len(group) > self.per_key:
                self.held_chars -= len(group.pop().text)
            while self.held_chars > self.max_chars and len(self.seen) > 1:
                _, old = self.seen.popitem(last=False)
                self.held_chars -= sum(len(s.text) for s in old)

    def _verify(self, text: str, specials: bool, got: bytes) -> None:
        if self.disabled is None and got != self._full(text, specials):
            self.disabled = "a chunked encoding differed from the full one"
            self.clear()
            log.warning("tokenizer_chunking_off", reason=self.disabled)
